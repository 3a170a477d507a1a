"""Expert parallelism: the experts of mixture-of-experts layers split over a group of ranks.

* :mod:`fxpipe.experts.regions` finds the expert computation on a traced graph (weights with a
  leading expert dimension, the per-expert ops between the tokens' dispatch and combine);
* :mod:`fxpipe.experts.all_to_all` moves each expert's token slots to the rank that holds it
  and back (autograd all-to-alls);
* :mod:`fxpipe.experts.rewrite` runs a stage's expert regions on this rank's experts.
"""
