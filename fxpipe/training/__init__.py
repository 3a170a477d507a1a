"""The training side: ``fxpipe.compile`` for your own loop, and ``fxpipe run`` on top of it.

Takes a spec or a Plan; gives a trained model. ``compiled`` (:func:`fxpipe.compile`) builds
this rank's share of the model inside any torchrun script: ``step()`` runs one global batch
through the schedule and leaves the all-reduced gradients for the script's own optimizer,
with clipping, accumulation, forward-only evaluation (``eval_graphs``: eval-mode copies of
the traced stage graphs) and FQN-keyed state. ``launch`` plans in this process and starts one
worker per device through torchrun's launcher; ``worker`` (``python -m fxpipe.training.worker``)
is a training loop on ``compile`` driven by the spec (``lr_schedule``: warm-up and cosine);
``losses`` names the loss functions; ``checkpoint`` saves and loads torch.distributed.checkpoint
folders keyed by the original FQNs; ``evaluate`` measures the held-out loss; ``run_record``
puts the optimizer steps on the measured timeline and writes ``environment.json``;
``profiling`` (``fxpipe profile``) measures the spec's costs on this machine. The run's
pictures, ``report.html`` and the progress display come from :mod:`fxpipe.reports`. The CLI
(:mod:`fxpipe.cli`) sits on top.
"""
