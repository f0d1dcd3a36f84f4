#!/usr/bin/env bash
# A real one-node SLURM on this machine, for testing the job templates in jobs/.
#
#   tests/slurm/local-slurm.sh up       install (apt-get) if needed, configure, start, wait for idle
#   tests/slurm/local-slurm.sh down     stop exactly the daemons `up` started (by their PIDs)
#   tests/slurm/local-slurm.sh status   what runs, and the line to export for the clients
#
# Everything lives in $HPCDIST_SLURM_DIR (default /tmp/hpcdist-slurm): slurm.conf, a munge key
# and socket of its own, state, spool, logs and the daemons' PID files. Nothing under /etc is
# changed; clients find the cluster through SLURM_CONF=$HPCDIST_SLURM_DIR/slurm.conf.
#
# Needs root and apt-get (Debian's slurmctld, slurmd, slurm-client and munge). Exit codes:
# 0 ready / stopped, 1 failed, 3 cannot run here (not root, no apt-get): tests skip on 3.
#
# What these machines taught us (2 cores, no systemd, no cgroups):
# - SlurmdParameters=config_overrides with CPUs=8 lets 8 tasks run on 2 real cores;
# - proctrack/linuxproc and task/none work without cgroups;
# - with MpiDefault=none, `srun` without --mpi=pmi2 starts N separate rank-0 processes:
#   templates must pass --mpi=pmi2 (the MPICH wheel supports PMI-2, refuses PMIx);
# - EnforcePartLimits=ALL turns an impossible request into an error at submission instead of a
#   job pending forever;
# - every package is installed before slurmd starts;
# - a requeued job waits cred_expire + 1 s before it may start again (120 s by default):
#   cred_expire=10 here keeps the requeue tests short.
set -euo pipefail

DIR=${HPCDIST_SLURM_DIR:-/tmp/hpcdist-slurm}
CPUS=${HPCDIST_SLURM_CPUS:-8}
GPUS=${HPCDIST_SLURM_GPUS:-2}      # declared only (see gres.conf below)
CTLD_PORT=${HPCDIST_SLURM_PORT:-16817}
SLURMD_PORT=$((CTLD_PORT + 1))
CONF=$DIR/slurm.conf
HOST=$(hostname -s)
FIRST_JOB_ID=$(( $(date +%s) % 50000000 + 1000 ))
PACKAGES="slurmctld slurmd slurm-client munge"

say() { echo "local-slurm: $*" >&2; }
cannot() { say "cannot run here: $*"; exit 3; }

alive() {  # alive NAME: the PID in $DIR/NAME.pid runs the program NAME
    local pidfile=$DIR/$1.pid pid
    [[ -f $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$1"
}

start() {  # start NAME CMD...: run a daemon in the foreground mode, in the background
    local name=$1; shift
    if alive "$name"; then say "$name already running (pid $(<"$DIR/$name.pid"))"; return; fi
    setsid "$@" >>"$DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$DIR/$name.pid"
}

stop() {  # stop NAME: TERM, wait up to 10 s, then KILL; only the PID we recorded
    local name=$1 pid i
    if ! alive "$name"; then rm -f "$DIR/$name.pid"; return; fi
    pid=$(<"$DIR/$name.pid")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$DIR/$name.pid"
    say "stopped $name (pid $pid)"
}

install() {
    local missing=0 p
    for p in slurmctld slurmd sbatch munged; do command -v "$p" >/dev/null || missing=1; done
    [[ $missing == 0 ]] && return
    [[ $(id -u) == 0 ]] || cannot "SLURM is not installed and installing it needs root"
    command -v apt-get >/dev/null || cannot "SLURM is not installed and there is no apt-get"
    say "installing $PACKAGES (apt-get)"
    apt-get update -qq >/dev/null || cannot "apt-get update failed (no package registry?)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PACKAGES >/dev/null \
        || cannot "apt-get install $PACKAGES failed"
}

configure() {
    mkdir -p "$DIR"/{state,spool,log,munge}
    chmod 700 "$DIR/munge"
    if [[ ! -s $DIR/munge/munge.key ]]; then
        head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
        chmod 400 "$DIR/munge/munge.key"
    fi
    cat >"$CONF" <<EOF
# Written by tests/slurm/local-slurm.sh: a one-node cluster on $HOST for hpcdist's tests.
ClusterName=hpcdist-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.daemon.pid
SlurmdPidFile=$DIR/slurmd.daemon.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
# slurmctld starts clean (-c) each time; fresh job ids keep the templates' appended logs
# (<name>-<id>.out) from meeting those of an earlier cluster
FirstJobId=$FIRST_JOB_ID
MinJobAge=600
KillWait=10
InactiveLimit=0
SchedulerParameters=sched_interval=2,bf_interval=2
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS Gres=gpu:$GPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    # GPUs declared with no device files behind them: jobs can ask for them (--gpus-per-task)
    # and the GPU templates' checks run for real; anything that touches a GPU fails, as it
    # should on a machine without one.
    { echo "AutoDetect=off"; for ((i = 0; i < GPUS; i++)); do echo "NodeName=$HOST Name=gpu File=$DIR/fake-gpu$i"; done; } >"$DIR/gres.conf"
    for ((i = 0; i < GPUS; i++)); do [[ -e $DIR/fake-gpu$i ]] || mknod "$DIR/fake-gpu$i" c 1 3; done
}

wait_idle() {  # returns 1 (with the logs' tails) if the node is not idle within 60 s
    local i state=""
    for i in $(seq 120); do
        state=$(SLURM_CONF=$CONF sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        if [[ $state == idle ]]; then say "node $HOST idle after $((i / 2)) s"; return 0; fi
        alive slurmctld && alive slurmd || break
        sleep 0.5
    done
    say "node $HOST not idle (state '${state:-none}'); the logs in $DIR/log end with:"
    tail -n 8 "$DIR"/log/*.log "$DIR"/log/*.out >&2 2>/dev/null || true
    return 1
}

up() {
    [[ $(id -u) == 0 ]] || cannot "the daemons run as root here (SlurmUser=root); run as root"
    install
    configure
    start munged munged --foreground --force --socket="$DIR/munge/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --seed-file="$DIR/munge/munged.seed" --log-file="$DIR/log/munged.log"
    for _ in $(seq 50); do [[ -S $DIR/munge/munge.socket ]] && break; sleep 0.1; done
    if [[ ! -S $DIR/munge/munge.socket ]]; then
        say "munged did not start: $(tail -n 5 "$DIR/log/munged.out" 2>/dev/null)"
        down
        exit 1
    fi
    start slurmctld slurmctld -D -c -f "$CONF"
    start slurmd slurmd -D -f "$CONF"
    wait_idle || { down; exit 1; }      # leave nothing half-started behind
    echo "export SLURM_CONF=$CONF"
}

down() {
    stop slurmd
    stop slurmctld
    stop munged
}

status() {
    local name
    for name in munged slurmctld slurmd; do
        if alive "$name"; then echo "$name running (pid $(<"$DIR/$name.pid"))";
        else echo "$name not running"; fi
    done
    echo "export SLURM_CONF=$CONF"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
