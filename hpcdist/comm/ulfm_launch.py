"""How a job with in-job recovery (comm/ulfm.py) is launched under Open MPI: read by the
trainer's messages, the recovery bench and the tests. A module of plain strings, but its
package's __init__ loads the Communicator and so mpi4py (its MPI is initialized on import):
a process that must not start MPI copies the strings instead (jobs/common.sh, --help)."""

LAUNCH = "mpirun --with-ft ulfm --mca btl tcp,self"
# --respawn: the processes MPI_Comm_spawn starts are a job of their own to Open MPI's runtime
# (PRRTE), and `--with-ft ulfm` makes only the first job recoverable. Without these a spawned
# replacement that dies takes its job down the non-recoverable path: PRRTE reports "exiting
# improperly", later loses track of the jobs that launched others ("LAUNCHER JOB OBJECT NOT
# FOUND") and, after several spawns, SIGKILLs ranks of the first job (two 10-minute ZeRO-3
# runs at 8 ranks died so). These make every job's default recoverable, with
# errors notified: PRRTE 3.0's state_base_recoverable / notify_errors.
RESPAWN_FLAGS = "--prtemca state_base_recoverable 1 --prtemca state_base_notify_errors 1"
