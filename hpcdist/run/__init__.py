"""A training run's plumbing, above the parallel layer: its settings (``config``,
``config_help``), the checks and records around it (``runtime``, ``savedir``,
``supervisor``, ``preemption``) and what it reports (``report``, ``evaluate``, ``mfu``).
Light to import: ``supervisor`` runs before MPI starts."""
