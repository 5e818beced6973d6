#!/usr/bin/env bash
# A real Slurm cluster on one machine: one slurmctld, N slurmd "nodes" (node1..nodeN, each its
# own port) and a private munged, all under one state directory, so the Slurm scheduler plugin
# is tested against Slurm itself and nothing of the system (its munge key, /etc/slurm, ports
# 6817/6818) is touched.
#
# Where the nodes run: by default every slurmd is on this machine's loopback (NodeAddr
# 127.0.0.1). Given PLANARIA_SLURM_HOSTS, each node is a host of its own: node i's slurmd runs
# in the i-th network namespace named there, and Slurm reaches it at that namespace's address
# (its NodeAddr); slurmctld and munged stay on this machine, slurmctld reached at
# PLANARIA_SLURM_CONTROLLER (this machine's address on the namespaces' network), so that
# sbatch, srun and scontrol work from here as from a login node. The caller makes and removes
# the namespaces (the tests: planaria.testing.netns.Network(..., host=True)); munge's socket
# is a file, which every namespace reaches.
#
#   cluster.sh install        apt-get what is missing (fast no-op when installed)
#   cluster.sh start [NODES]  start NODES nodes (default 4), wait until all are idle,
#                             print the export lines (so `eval "$(cluster.sh start)"` works)
#   cluster.sh env            the export lines a client shell needs
#   cluster.sh status         sinfo + squeue
#   cluster.sh stop           cancel jobs, stop every daemon, remove the state directory
#
# Env: PLANARIA_SLURM_DIR (state directory, default /tmp/planaria-slurm),
#      PLANARIA_SLURM_PORT (slurmctld port, default 16817; slurmd nodeN uses PORT+N),
#      PLANARIA_SLURM_CPUS (CPUs per node, default 2), KEEP_LOGS=1 (stop keeps DIR/log),
#      PLANARIA_SLURM_TOPOLOGY (tree, the default: the nodes' first half under leaf switch s1,
#      the rest under s2, both under switch top, in DIR/etc/topology.conf; none: no topology
#      plugin, as on a cluster without one),
#      PLANARIA_SLURM_HOSTS ("NETNS=ADDRESS ...", one per node, in order: the namespace each
#      slurmd runs in and its address), PLANARIA_SLURM_CONTROLLER (the address the nodes
#      reach slurmctld at; needed with PLANARIA_SLURM_HOSTS, default 127.0.0.1).
set -euo pipefail

DIR=${PLANARIA_SLURM_DIR:-/tmp/planaria-slurm}
DIR=${DIR%/}
PORT=${PLANARIA_SLURM_PORT:-16817}
CPUS=${PLANARIA_SLURM_CPUS:-2}
HOSTS=${PLANARIA_SLURM_HOSTS:-}
TOPOLOGY=${PLANARIA_SLURM_TOPOLOGY:-tree}
CONTROLLER=${PLANARIA_SLURM_CONTROLLER:-}
CONF=$DIR/etc/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
# Set only in the daemons' environment (slurmstepd inherits it): `stop` finds strays by it
# without ever matching a user's shell, which may carry PLANARIA_SLURM_DIR.
MARKER=PLANARIA_SLURM_DAEMON=$DIR
# Written at start: `stop` removes DIR only when it holds this, never a directory of someone else.
STAMP=$DIR/.planaria-slurm

log() { echo "cluster.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root: the daemons run as SlurmUser=root (try: sudo $0 $*)"
}

cmd_install() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    need_root install
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Keep apt from starting the system's own munged/slurmd: ours run from DIR.
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    local rc=0
    { apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null &&
            apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; }; } || rc=$?
    if ((made_policy)); then rm -f "$policy"; fi
    ((rc == 0)) || die "apt-get install slurm-wlm munge failed (exit $rc)"
}

# PLANARIA_SLURM_HOSTS into NETNS_OF[i] and ADDR_OF[i] (i from 1), checked against NODES.
NETNS_OF=()
ADDR_OF=()
parse_hosts() {
    local nodes=$1 entry i=0 ipv4='^([0-9]{1,3}\.){3}[0-9]{1,3}$'
    [[ -n $HOSTS ]] || return 0
    for entry in $HOSTS; do
        i=$((i + 1))
        [[ $entry == *=* ]] ||
            die "PLANARIA_SLURM_HOSTS: '$entry' is not NETNS=ADDRESS (node $i)"
        NETNS_OF[i]=${entry%%=*}
        ADDR_OF[i]=${entry#*=}
        [[ -e /run/netns/${NETNS_OF[i]} ]] ||
            die "PLANARIA_SLURM_HOSTS: no network namespace '${NETNS_OF[i]}' (node $i; ip netns list)"
        [[ ${ADDR_OF[i]} =~ $ipv4 ]] ||
            die "PLANARIA_SLURM_HOSTS: '${ADDR_OF[i]}' is not an IPv4 address (node $i)"
    done
    ((i == nodes)) || die "PLANARIA_SLURM_HOSTS names $i hosts for $nodes nodes"
    [[ $CONTROLLER =~ $ipv4 ]] ||
        die "PLANARIA_SLURM_CONTROLLER must be this machine's IPv4 address on the nodes'" \
            "network (with PLANARIA_SLURM_HOSTS), got '${CONTROLLER}'"
}

write_conf() {
    local nodes=$1 host i where
    host=$(hostname -s)
    where="on localhost"
    [[ -z $HOSTS ]] || where="in network namespaces of their own"
    {
        echo "# Written by cluster.sh: a ${nodes}-node cluster, nodes ${where}; removed by 'stop'."
        echo "ClusterName=planaria"
        # slurmctld must find its own short hostname here; clients and nodes reach it at the
        # address in parentheses (it listens on every address).
        echo "SlurmctldHost=${host}(${CONTROLLER:-127.0.0.1})"
        echo "SlurmctldPort=$PORT"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # cred_expire is also how long a requeued job waits before it may start again
        # (default 120 s): short, so requeue tests are quick.
        echo "AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10"
        echo "StateSaveLocation=$DIR/spool/ctld"
        echo "SlurmdSpoolDir=$DIR/spool/slurmd.%n"
        echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/run/slurmd.%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd.%n.log"
        echo "MailProg=/bin/true"
        echo "JobCompType=jobcomp/filetxt"
        echo "JobCompLoc=$DIR/log/jobcomp.txt"
        # No cgroups: containers and CI runners rarely let us have them.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        # Whole nodes per job, as on most training clusters; a job that asks for
        # --oversubscribe may share (the partition allows it).
        echo "SelectType=select/linear"
        # Nodes may claim more CPUs than this host has (PLANARIA_SLURM_CPUS).
        echo "SlurmdParameters=config_overrides"
        echo "JobRequeue=1"
        # A node that stopped answering comes back when its slurmd registers; one set DOWN by
        # scontrol stays down (=2 would undo that at once).
        echo "ReturnToService=1"
        # Short timeouts so fault tests do not wait minutes: a dead slurmd is DOWN after
        # SlurmdTimeout, a cancelled job gets SIGKILL KillWait seconds after SIGTERM.
        echo "SlurmdTimeout=20"
        echo "SlurmctldTimeout=20"
        echo "KillWait=5"
        echo "InactiveLimit=0"
        echo "MinJobAge=300"
        echo "SchedulerType=sched/backfill"
        # Schedule a batch job at submit time (default: up to 3 s later) and look at the
        # pending queue every 5 s (default 60 s), so tests see jobs start within a second.
        echo "SchedulerParameters=batch_sched_delay=0,sched_interval=5"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        for ((i = 1; i <= nodes; i++)); do
            echo "NodeName=node$i NodeHostname=localhost NodeAddr=${ADDR_OF[i]:-127.0.0.1}" \
                "Port=$((PORT + i))" \
                "CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1" \
                "RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP" \
            "OverSubscribe=YES"
        if [[ $TOPOLOGY == tree ]]; then
            # Where each node sits, as a cluster's network would have it (scontrol show
            # topology): the scheduler plugin reads it, and rank placement follows it.
            echo "TopologyPlugin=topology/tree"
        fi
    } >"$CONF"
    [[ $TOPOLOGY == tree ]] || return 0
    # Two leaf switches (one when there is one node) under a top switch: Slurm places a job
    # across leaf switches only where a switch above joins them.
    local half=$(((nodes + 1) / 2))
    {
        echo "# Written by cluster.sh: the nodes' first half under s1, the rest under s2."
        echo "SwitchName=s1 Nodes=node[1-$half]"
        if ((nodes > half)); then
            echo "SwitchName=s2 Nodes=node[$((half + 1))-$nodes]"
            echo "SwitchName=top Switches=s[1-2]"
        fi
    } >"$DIR/etc/topology.conf"
}

# Alive and not a zombie (a zombie holds no socket; where init reaps late, it lingers).
pid_alive() {
    [[ -n ${1:-} ]] && kill -0 "$1" 2>/dev/null &&
        [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]
}
pid_of() { cat "$1" 2>/dev/null || true; }

configured_nodes() { grep -c '^NodeName=' "$CONF" 2>/dev/null || true; }

print_env() {
    echo "export SLURM_CONF=$CONF"
    echo "export PLANARIA_SLURM_DIR=$DIR"
}

log_tails() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -f $f ]] || continue
        echo "---- $f (last 15 lines)" >&2
        tail -n 15 "$f" >&2
    done
}

start_munged() {
    local key=$DIR/munge/munge.key
    if [[ ! -s $key ]]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile="$key" >/dev/null
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
    fi
    chmod 0400 "$key"
    env "$MARKER" munged --socket="$MUNGE_SOCKET" --key-file="$key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" || fail_start "munged did not start"
}

# A start that failed: show why, then take down what did start (logs stay for a look).
fail_start() {
    log_tails
    KEEP_LOGS=1 cmd_stop || true
    die "$1 (logs above and in $DIR/log)"
}

cmd_start() {
    local nodes=${1:-4} i t0 deadline states
    [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive integer, got '$nodes'"
    [[ $TOPOLOGY == tree || $TOPOLOGY == none ]] ||
        die "PLANARIA_SLURM_TOPOLOGY must be tree or none, got '$TOPOLOGY'"
    need_root start
    if pid_alive "$(pid_of "$DIR/run/slurmctld.pid")"; then
        local running=none
        ! grep -q '^TopologyPlugin=topology/tree' "$CONF" || running=tree
        if [[ $running != "$TOPOLOGY" ]]; then
            die "the cluster running in $DIR has topology $running, not $TOPOLOGY;" \
                "run '$0 stop' first"
        fi
        if [[ $(configured_nodes) -eq $nodes ]]; then
            log "already running with $nodes nodes in $DIR"
            print_env
            return 0
        fi
        die "a $(configured_nodes)-node cluster is already running in $DIR; run '$0 stop' first"
    fi
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        die "Slurm or munge is not installed; run '$0 install' first"
    fi
    parse_hosts "$nodes"
    t0=$(date +%s.%N)
    if [[ -e $DIR && ! -e $STAMP && -n $(ls -A "$DIR" 2>/dev/null) ]]; then
        die "$DIR exists and was not made by cluster.sh; set PLANARIA_SLURM_DIR to a new path"
    fi
    # Leftovers of a run that was not stopped (a killed CI job, a removed DIR whose daemons
    # still hold the ports) would confuse the new one.
    QUIET=1 cmd_stop
    umask 022
    mkdir -p "$DIR"/{etc,spool/ctld,run,log,munge}
    # munged refuses a socket directory that others cannot search, or may write.
    chmod 0755 "$DIR" "$DIR/munge"
    : >"$STAMP"
    for ((i = 1; i <= nodes; i++)); do mkdir -p "$DIR/spool/slurmd.node$i"; done
    write_conf "$nodes"
    start_munged
    export SLURM_CONF=$CONF
    env "$MARKER" slurmctld -c -f "$CONF" || fail_start "slurmctld did not start"
    local inside
    for ((i = 1; i <= nodes; i++)); do
        inside=()
        # nsenter, not `ip netns exec`: that one also mounts a sysfs of the namespace's own
        # over /sys, which hides /sys/fs/cgroup, and slurmd will not start without it.
        [[ -z ${NETNS_OF[i]:-} ]] || inside=(nsenter "--net=/run/netns/${NETNS_OF[i]}")
        "${inside[@]}" env "$MARKER" slurmd -N "node$i" -f "$CONF" ||
            fail_start "slurmd -N node$i did not start${NETNS_OF[i]:+ in ${NETNS_OF[i]}}"
    done
    deadline=$(($(date +%s) + 60))
    while :; do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
        if [[ $(grep -c ' idle$' <<<"$states") -eq $nodes ]]; then
            break
        fi
        if (($(date +%s) >= deadline)); then
            echo "sinfo:" >&2
            echo "${states:-(no answer from slurmctld)}" >&2
            fail_start "not all $nodes nodes became idle within 60 s"
        fi
        if [[ -s $DIR/run/slurmctld.pid ]] && ! pid_alive "$(pid_of "$DIR/run/slurmctld.pid")"; then
            fail_start "slurmctld exited"
        fi
        sleep 0.2
    done
    log "$nodes nodes idle in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s" \
        "(state in $DIR)"
    print_env
}

# Every process of this cluster: daemons (marker in their environment or DIR on their command
# line), then everything below a slurmstepd of ours (job processes), never this script or
# its callers.
our_pids() {
    local keep=" $$ " p comm pid
    p=$$
    while [[ $p -gt 1 ]]; do
        p=$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)
        p=${p:-1}
        keep+="$p "
    done
    local roots=()
    for pid in /proc/[0-9]*; do
        pid=${pid#/proc/}
        [[ $keep == *" $pid "* ]] && continue
        comm=$(cat "/proc/$pid/comm" 2>/dev/null) || continue
        case $comm in slurmctld | slurmscriptd | slurmd | slurmstepd | munged) ;; *) continue ;; esac
        if tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qxF "$MARKER" ||
            tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$DIR/"; then
            roots+=("$pid")
        fi
    done
    ((${#roots[@]})) || return 0
    # Descendants of the roots (job tasks are children of slurmstepd).
    ps -e -o pid=,ppid= | awk -v roots="${roots[*]}" -v keep="$keep" '
        { parent[$1] = $2; pids[NR] = $1 }
        END {
            n = split(roots, r, " "); for (i = 1; i <= n; i++) ours[r[i]] = 1
            changed = 1
            while (changed) {
                changed = 0
                for (i in pids) { q = pids[i]; if (!(q in ours) && (parent[q] in ours)) { ours[q] = 1; changed = 1 } }
            }
            for (q in ours) if (index(keep, " " q " ") == 0) print q
        }'
}

wait_gone() {
    local deadline=$(($(date +%s) + $1)) pid
    shift
    while :; do
        local alive=()
        for pid in "$@"; do pid_alive "$pid" && alive+=("$pid"); done
        ((${#alive[@]} == 0)) && return 0
        (($(date +%s) >= deadline)) && return 1
        sleep 0.1
    done
}

# Stop the daemons named by pid files: wait up to $1 s for them to exit on their own, then
# SIGTERM, then SIGKILL.
stop_pids() {
    local grace=$1 f pid pids=()
    shift
    for f in "$@"; do
        pid=$(pid_of "$f")
        pid_alive "$pid" && pids+=("$pid")
    done
    ((${#pids[@]})) || return 0
    wait_gone "$grace" "${pids[@]}" && return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait_gone 5 "${pids[@]}" && return 0
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait_gone 5 "${pids[@]}"
}

cmd_stop() {
    local ctld
    ctld=$(pid_of "$DIR/run/slurmctld.pid")
    if [[ -f $CONF ]] && pid_alive "$ctld"; then
        export SLURM_CONF=$CONF
        local jobs
        jobs=$(timeout 10 squeue -h -o '%A' 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs 2>/dev/null || true
            local deadline=$(($(date +%s) + 15))
            while [[ -n $(timeout 5 squeue -h -o '%A' 2>/dev/null || true) ]] &&
                (($(date +%s) < deadline)); do
                sleep 0.2
            done
        fi
        timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    fi
    # Slurm's daemons first (they need munged to hear the shutdown), then munged.
    stop_pids 10 "$DIR"/run/slurm*.pid
    stop_pids 0 "$DIR"/run/munged.pid
    local stray
    mapfile -t stray < <(our_pids)
    if ((${#stray[@]})); then
        kill -KILL "${stray[@]}" 2>/dev/null || true
        wait_gone 10 "${stray[@]}" || die "processes ${stray[*]} of $DIR survived SIGKILL"
    fi
    if [[ -e $STAMP ]]; then
        if [[ ${KEEP_LOGS:-0} == 1 ]]; then
            find "$DIR" -mindepth 1 -maxdepth 1 ! -name log ! -name "${STAMP##*/}" -exec rm -rf {} +
            [[ -n ${QUIET:-} ]] || log "stopped; logs kept in $DIR/log"
        else
            rm -rf "$DIR"
            [[ -n ${QUIET:-} ]] || log "stopped"
        fi
    fi
}

cmd_status() {
    [[ -f $CONF ]] || die "no cluster in $DIR (start one with '$0 start')"
    export SLURM_CONF=$CONF
    sinfo -N -o '%N %P %T %c %E'
    squeue -o '%i %j %T %D %N %R'
    squeue -s -o '%i %j %N'
}

case ${1:-} in
install) cmd_install ;;
start)
    shift
    cmd_start "$@"
    ;;
env)
    [[ -f $CONF ]] || die "no cluster in $DIR (start one with '$0 start')"
    print_env
    ;;
stop) cmd_stop ;;
status) cmd_status ;;
*)
    sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
