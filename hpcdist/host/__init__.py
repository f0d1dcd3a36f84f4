"""This process on its host, for every layer above: BLAS threads per rank (``threads``), what
a signal means to the run (``signals``), the timeline of spans and collectives
(``timeline``), the run's axis sizes (``layout``). They import nothing of hpcdist but the
device layer."""
