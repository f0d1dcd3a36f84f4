"""This process on its host, for every layer above: BLAS threads per rank (``threads``), what
a signal means to the run (``signals``), the timeline of spans and collectives
(``timeline``), the run's axis sizes (``layout``), every command's parser (``cli``: flags
matched whole), whose files a folder holds (``folders``) and the limits MPI cannot start
under (``limits``). They import nothing of hpcdist but the device layer."""
