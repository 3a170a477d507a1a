"""How a stage's graph runs on a device, shared by the runtime and by the planner's profiler
(which measures what the runtime will run): :mod:`~fxpipe.execution.rebuild` (a GraphModule
around a new graph keeping its root's ``state_dict()`` keys), :mod:`~fxpipe.execution.grad_fusion`
(weight gradients accumulated into ``.grad`` in place), :mod:`~fxpipe.execution.dtypes` (autocast
and message dtypes of ``train.precision``), :mod:`~fxpipe.execution.host_memory` (a CPU rank's
allocator), :mod:`~fxpipe.execution.compiled_stage` (stages through torch.compile,
``train.compile``). Imports only torch and :mod:`fxpipe.errors`."""
