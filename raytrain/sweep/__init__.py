"""Hyperparameter sweeps on Ray Tune (``raytrain tune``): the search space (``space``),
one trial as a whole raytrain run (``trial``), the sweep's driver (``runner``), what it
returns (``results``) and its picture (``plot``)."""
