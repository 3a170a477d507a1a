"""The training side: ``fxpipe run`` from a spec to a trained model on disk.

Takes a spec; gives a run folder. ``launch`` plans in this process and starts one worker per
device through torchrun's launcher; ``worker`` (``python -m fxpipe.training.worker``) rebuilds its
stages from the Plan and trains them with the runtime's executor; ``losses`` names the loss
functions; ``checkpoint`` saves and loads torch.distributed.checkpoint folders keyed by the
original FQNs; ``evaluate`` measures the held-out loss. The CLI (:mod:`fxpipe.cli`) sits on top.
"""
