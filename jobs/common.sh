# Shared by the job templates in jobs/ (sourced, not submitted). Bash.
#
# hpcdist_init             check the job and the checkout, set PYTHON, RUN_DIR, thread counts
# hpcdist_tasks_per_node   the most tasks SLURM placed on one node
# hpcdist_gpus_per_node    GPUs allocated on this node (0 if none)
# hpcdist_preflight ARGS   python -m hpcdist.preflight: stop now on a bad setting
# hpcdist_launch CMD...    run CMD on every task (srun --mpi=pmi2, or mpirun) and requeue the
#                          job if it was signalled and checkpointed (see below)
#
# Environment a user may set (sbatch --export=ALL,NAME=value, or export before sbatch):
#   HPCDIST_DIR      the hpcdist checkout (default: the directory sbatch ran in)
#   PYTHON           a Python with hpcdist installed (default: $HPCDIST_DIR/.venv/bin/python)
#   HPCDIST_RUN_DIR  outputs and checkpoints (default: $HPCDIST_DIR/runs/<job name>-<job id>)
#   LAUNCHER         srun (default) or mpirun (mpirun -n $SLURM_NTASKS inside the allocation)
#   SRUN_MPI         srun's --mpi plugin: pmi2 (default: what the MPICH wheel and most MPIs
#                    speak) or pmix (Open MPI 5, recent Intel MPI): jobs/README.md, "Launching"
#   SRUN_ARGS        extra srun options (e.g. "--cpu-bind=cores")
#   MPIRUN_ARGS      extra mpirun options (LAUNCHER=mpirun; e.g. "--bind-to none" where the
#                    allocation declares more CPUs than the node has)
#
# Requeue: the templates ask SLURM for `--signal=B:USR1@SECONDS` (USR1 to this batch shell
# that long before the time limit) and `--requeue`. On USR1 the shell forwards the signal to
# the launcher, which forwards it to every rank; the ranks agree to stop after the current
# step, save a checkpoint and exit with code 75; the shell then runs `scontrol requeue`. The
# requeued job has the same job id, so the same RUN_DIR, and `--resume` continues from the
# checkpoint. The log (--open-mode=append) keeps every attempt.

EXIT_PREEMPTED=75

hpcdist_die() {
    echo "hpcdist job ${SLURM_JOB_ID:-}: error: $*" >&2
    exit 2
}

hpcdist_init() {
    [[ -n ${SLURM_JOB_ID:-} ]] || hpcdist_die "not inside a SLURM job: submit with sbatch"
    HPCDIST_DIR=${HPCDIST_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    [[ -f $HPCDIST_DIR/hpcdist/train.py ]] \
        || hpcdist_die "$HPCDIST_DIR is not an hpcdist checkout: submit from the repository root or set HPCDIST_DIR"
    cd "$HPCDIST_DIR"
    PYTHON=${PYTHON:-$HPCDIST_DIR/.venv/bin/python}
    [[ -x $PYTHON ]] \
        || hpcdist_die "no Python at $PYTHON: run 'make venv' in $HPCDIST_DIR, or set PYTHON to one with hpcdist installed"
    # one BLAS/OpenMP thread per core given to the task: ranks share cores without fighting
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$OMP_NUM_THREADS}
    export MKL_NUM_THREADS=${MKL_NUM_THREADS:-$OMP_NUM_THREADS}
    RUN_DIR=${HPCDIST_RUN_DIR:-$HPCDIST_DIR/runs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
    mkdir -p "$RUN_DIR/checkpoints"   # (--resume refuses a missing folder; an empty one starts)
    LAUNCHER=${LAUNCHER:-srun}
    case $LAUNCHER in srun|mpirun) ;; *) hpcdist_die "LAUNCHER must be srun or mpirun, got '$LAUNCHER'" ;; esac
    echo "hpcdist job $SLURM_JOB_ID ($SLURM_JOB_NAME), attempt $((${SLURM_RESTART_COUNT:-0} + 1)):" \
         "${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s) [${SLURM_JOB_NODELIST:-?}]," \
         "$(hpcdist_gpus_per_node) GPU(s) per node, $(date '+%F %T')"
    echo "hpcdist: python $PYTHON | outputs $RUN_DIR | launcher $LAUNCHER"
}

hpcdist_tasks_per_node() {
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the largest count is what one node must hold
    local spec=${SLURM_TASKS_PER_NODE:-${SLURM_NTASKS:-1}} part n max=0
    IFS=, read -ra parts <<<"$spec"
    for part in "${parts[@]}"; do
        n=${part%%(*}
        (( n > max )) && max=$n
    done
    (( ${SLURM_NTASKS:-$max} < max )) && max=$SLURM_NTASKS       # -n below --ntasks-per-node
    echo "$max"
}

hpcdist_gpus_per_node() {
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
        IFS=, read -ra devs <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#devs[@]}"
    else
        echo 0
    fi
}

hpcdist_cupy() {
    # CuPy in PYTHON, as `make venv` picks it: the wheel for the driver's CUDA major version
    "$PYTHON" -c "import cupy" 2>/dev/null && return 0
    local cuda
    # (|| true: without nvidia-smi the pipeline fails, and set -e -o pipefail would end the
    # job with 127 instead of the message below)
    cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1 || true)
    case $cuda in
        12|13) echo "hpcdist: no CuPy in $PYTHON; installing cupy-cuda${cuda}x (CUDA $cuda driver)"
               "$PYTHON" -m pip install -q -e "$HPCDIST_DIR[gpu-cuda$cuda]" \
                   || hpcdist_die "installing CuPy failed (no network on the node?): run 'make venv' on a GPU node, or pip install -e '.[gpu-cuda$cuda]'" ;;
        "") echo "hpcdist: no CuPy in $PYTHON and no nvidia-smi here: nothing installed" ;;
        *) hpcdist_die "CUDA $cuda: no CuPy extra for it; pip install the matching cupy-cuda*x into $PYTHON" ;;
    esac
}

hpcdist_preflight() {
    # hpcdist_preflight [preflight options] -- [training options]
    "$PYTHON" -m hpcdist.preflight --world "${SLURM_NTASKS:-1}" \
        --tasks-per-node "$(hpcdist_tasks_per_node)" --gpus-per-node "$(hpcdist_gpus_per_node)" \
        "$@" || hpcdist_die "preflight failed (above); nothing was launched"
}

hpcdist_launch() {
    local -a launch
    local shrink=0 a prev=""
    for a in "$@"; do   # --on-failure shrink: Open MPI's mpirun with its fault tolerance on
        [[ $a == --on-failure=shrink || ( $prev == --on-failure && $a == shrink ) ]] && shrink=1
        prev=$a
    done
    if [[ $shrink == 1 && $LAUNCHER == srun ]]; then
        hpcdist_die "--on-failure shrink needs Open MPI's mpirun (submit with" \
            "--export=ALL,LAUNCHER=mpirun): srun ends the step when a task dies, and Open MPI" \
            "documents fault tolerance under mpirun only (jobs/README.md, 'In-job recovery')"
    fi
    if [[ $LAUNCHER == srun ]]; then
        # --mpi=pmi2 (SRUN_MPI): the MPICH wheel speaks PMI-2; without it (MpiDefault=none
        # on many clusters) srun starts N separate 1-rank worlds, which hpcdist refuses.
        # --kill-on-bad-exit: one failed rank ends the step.
        launch=(srun --mpi="${SRUN_MPI:-pmi2}" --kill-on-bad-exit=1 ${SRUN_ARGS:-})
    else
        # the MPI library's mpirun: on PATH (module load ...), else the one beside PYTHON
        local mpirun=mpirun
        command -v mpirun >/dev/null || mpirun=$(dirname "$PYTHON")/mpirun
        launch=("$mpirun" -n "${SLURM_NTASKS:-1}" ${MPIRUN_ARGS:-})
        # ULFM: a dead rank's peers get errors instead of the job ending (the shared-memory
        # transport hangs on a failure: TCP and self only); the --prtemca pair makes the jobs
        # --respawn spawns recoverable too (hpcdist/comm/ulfm.py, RESPAWN_FLAGS)
        [[ $shrink == 1 ]] && launch+=(--with-ft ulfm --mca btl tcp,self
                                       --prtemca state_base_recoverable 1
                                       --prtemca state_base_notify_errors 1)
    fi
    local signalled=0 child="" rc=0 again
    trap 'signalled=1
          echo "hpcdist job $SLURM_JOB_ID: USR1 at $(date +%T): asking every rank to checkpoint and stop"
          [[ -n $child ]] && kill -USR1 "$child" 2>/dev/null' USR1
    "${launch[@]}" "$@" &
    child=$!
    [[ $signalled == 1 ]] && kill -USR1 "$child" 2>/dev/null   # it came before child was set
    while :; do
        rc=0
        wait "$child" || rc=$?
        kill -0 "$child" 2>/dev/null || break                    # a trap cut the wait short
    done
    if (( rc > 128 )); then                                      # the trap ran as it ended
        again=0
        wait "$child" 2>/dev/null || again=$?
        (( again != 127 )) && rc=$again
    fi
    trap - USR1
    # 75: the ranks checkpointed and stopped; 138 (128 + USR1): a rank died of the signal
    # before it could (its last checkpoint still holds the run)
    if [[ $signalled == 1 ]] && (( rc == EXIT_PREEMPTED || rc == 138 )); then
        echo "hpcdist job $SLURM_JOB_ID: stopped with code $rc after USR1: requeueing" \
             "(the next attempt resumes from $RUN_DIR/checkpoints)"
        if scontrol requeue "$SLURM_JOB_ID"; then
            exit 0
        fi
        echo "hpcdist job $SLURM_JOB_ID: scontrol requeue failed (submitted without --requeue?);" \
             "resubmit the same command with HPCDIST_RUN_DIR=$RUN_DIR to resume" >&2
        exit "$rc"
    fi
    if (( rc == EXIT_PREEMPTED )); then
        echo "hpcdist job $SLURM_JOB_ID: the ranks checkpointed and stopped on a signal;" \
             "resubmit with HPCDIST_RUN_DIR=$RUN_DIR to resume" >&2
    fi
    return "$rc"
}
