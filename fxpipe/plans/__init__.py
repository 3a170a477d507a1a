"""The Plan: plain data where the partitioner and the runtime meet.

Takes what the partitioner decided (stage cuts, the values crossing them, placement, schedule,
predictions); gives a :class:`~fxpipe.plans.plan.Plan` with its JSON round trip (``plan.json``),
its derived views (stage edges, stage -> rank, :mod:`~fxpipe.plans.placement`) and its readable
views: the text table (:mod:`~fxpipe.plans.summary`), the DOT drawing (:mod:`~fxpipe.plans.dot`,
whose stage palette the pictures of :mod:`fxpipe.reports` share) and the dump folder
(:mod:`~fxpipe.plans.dump`). Imports errors, units, the typed spec and tensor placements, no
torch.

(The package is ``plans``, not ``plan``, so that ``fxpipe.plan`` stays the planning function.)
"""
