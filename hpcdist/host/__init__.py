"""This process on its host, for every layer above: BLAS threads per rank (``threads``), what
a signal means to the run (``signals``), the timeline of spans and collectives
(``timeline``). They import nothing of hpcdist but the device layer."""
