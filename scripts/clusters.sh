#!/usr/bin/env bash
# Private local clusters for the integration tests that need more than one
# node: a 6-node Redis Cluster (3 masters, 3 replicas) and a 3-node RabbitMQ
# cluster (with the consistent-hash plugin), built from Debian's packages that
# are already installed (redis-server, redis-cli, rabbitmq-server). All state,
# logs and pid files live under DIR; every node listens on 127.0.0.1 on free
# ports found by probing. The shared servers (127.0.0.1:6379, 127.0.0.1:5672
# and their node, cookie and /etc/rabbitmq files) are never touched; the
# shared epmd (4369) is used for registration and left running.
#
#   scripts/clusters.sh up DIR [--redis-only|--rabbit-only]
#       start both clusters, wait until they are fully ready and write DIR/env
#       (KEY=VALUE lines: REDIS_CLUSTER_NODES, REDIS_CLUSTER_MASTERS,
#       REDIS_CLUSTER_REPLICAS, RABBIT_NODES, RABBIT_AMQP_PORTS,
#       RABBIT_AMQP_URLS, RABBIT_HOME, RABBIT_NODE_ENV_FILES, ...).
#       An earlier cluster in DIR is stopped and its state wiped first.
#   scripts/clusters.sh down DIR
#       stop everything started in DIR (exits 0 if parts are already gone).
#   scripts/clusters.sh rabbit-stop DIR N    stop RabbitMQ node N (1..3): its VM exits
#   scripts/clusters.sh rabbit-kill DIR N    the same with SIGKILL (a crash)
#   scripts/clusters.sh rabbit-start DIR N   start it again; waits until it is
#                                            back in the cluster and serving AMQP
#   scripts/clusters.sh redis-kill DIR PORT  SIGKILL one redis-server (a crash)
#   scripts/clusters.sh redis-start DIR PORT start it again with its config;
#                                            waits until it has rejoined
#   scripts/clusters.sh rabbitmqctl DIR N ARGS...  rabbitmqctl against node N
#
# Each RabbitMQ node's environment (cookie HOME, node name, ports, files) is
# in DIR/rabbit/nodeN/node.env, KEY=VALUE lines (also fine for `set -a; .`),
# for anything that has to run the RabbitMQ CLI itself, e.g.
#   (set -a; . DIR/rabbit/node1/node.env; /usr/lib/rabbitmq/bin/rabbitmq-queues quorum_status q)
set -euo pipefail

PLUGIN=rabbitmq_consistent_hash_exchange
RABBIT_HOST=${CLUSTERS_RABBIT_HOST:-localhost}   # the short host of the shared node
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")

say() { echo "clusters: $*" >&2; }
die() { echo "clusters: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
now() { date +%s; }

# The RabbitMQ scripts themselves, not Debian's /usr/sbin wrappers: as root
# those `su rabbitmq`, which resets HOME (the cookie) and cds to
# /var/lib/rabbitmq. Run directly, a node runs as the calling user (root is
# fine) with everything under DIR.
if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
    RBIN=/usr/lib/rabbitmq/bin
elif have rabbitmq-server; then
    RBIN=$(dirname "$(command -v rabbitmq-server)")
else
    RBIN=
fi

# ---------------------------------------------------------------- ports

USED_PORTS=" 4369 5672 6379 15672 25672 "
# Sets PORT to a free port in [lo, hi) (below Linux's ephemeral range) not
# picked before; with OFF, port+OFF must be free too (Redis's cluster bus).
# Not in $(...): it remembers its picks in USED_PORTS.
pick_port() { # lo hi [off]
    local lo=$1 hi=$2 off=${3:-} p
    for _ in $(seq 1 200); do
        p=$((lo + RANDOM % (hi - lo)))
        case "$USED_PORTS" in *" $p "*) continue ;; esac
        port_open "$p" && continue
        if [ -n "$off" ]; then
            case "$USED_PORTS" in *" $((p + off)) "*) continue ;; esac
            port_open $((p + off)) && continue
        fi
        USED_PORTS="$USED_PORTS$p ${off:+$((p + off)) }"
        PORT=$p
        return 0
    done
    die "no free port in $lo..$hi"
}

# ---------------------------------------------------------------- env file

env_get() { # DIR KEY -> value ('' when missing)
    [ -f "$1/env" ] || return 0
    sed -n "s/^$2=//p" "$1/env" | tail -n 1
}

# ---------------------------------------------------------------- redis

redis_conf_dir() { echo "$1/redis/$2"; }

redis_pid() { # DIR PORT -> pid of our redis-server on PORT, if running
    local d pid
    d=$(redis_conf_dir "$1" "$2")
    pid=$(cat "$d/redis.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q "redis-server.*:$2\b" && echo "$pid"
}

redis_write_conf() { # DIR PORT
    local d
    d=$(redis_conf_dir "$1" "$2")
    mkdir -p "$d"
    cat >"$d/redis.conf" <<EOF
# clusters.sh: private Redis Cluster node
port $2
bind 127.0.0.1
protected-mode no
daemonize yes
dir $d
pidfile $d/redis.pid
logfile $d/redis.log
save ""
appendonly no
cluster-enabled yes
cluster-config-file $d/nodes.conf
cluster-node-timeout 1000
# a replica is always eligible for failover, however long its link was down
cluster-replica-validity-factor 0
EOF
}

redis_start_one() { # DIR PORT
    local d
    d=$(redis_conf_dir "$1" "$2")
    [ -f "$d/redis.conf" ] || die "no $d/redis.conf: not a port of this cluster"
    if redis_pid "$1" "$2" >/dev/null; then return 0; fi
    port_open "$2" && die "port $2 is taken by another process"
    redis-server "$d/redis.conf" >/dev/null
}

redis_ping() { redis-cli -p "$1" ping 2>/dev/null | grep -q PONG; }

redis_info_has() { # PORT SECTION PATTERN...
    local p=$1 sect=$2 out pat
    shift 2
    if [ "$sect" = cluster ]; then
        out=$(redis-cli -p "$p" cluster info 2>/dev/null | tr -d '\r') || return 1
    else
        out=$(redis-cli -p "$p" info "$sect" 2>/dev/null | tr -d '\r') || return 1
    fi
    for pat in "$@"; do grep -qx "$pat" <<<"$out" || return 1; done
}

redis_node_ready() { # PORT: cluster ok, all slots ok, 6 nodes, and its replication link up
    local p=$1 role
    redis_info_has "$p" cluster cluster_state:ok cluster_slots_ok:16384 cluster_known_nodes:6 || return 1
    role=$(redis-cli -p "$p" role 2>/dev/null | head -n 1 | tr -d '\r')
    case "$role" in
        master) return 0 ;;
        slave) redis_info_has "$p" replication master_link_status:up ;;
        *) return 1 ;;
    esac
}

wait_until() { # what seconds command...
    local what=$1 secs=$2 end
    shift 2
    end=$(($(now) + secs))
    while ! "$@" >/dev/null 2>&1; do
        [ "$(now)" -lt "$end" ] || return 1
        sleep 0.2
    done
    [ -n "$what" ] || true
}

redis_up() { # DIR
    local dir=$1 ports=() p i addrs=() masters=() replicas=() line nodes
    have redis-server && have redis-cli || die "redis-server/redis-cli not installed (Debian: apt-get install redis-server)"
    for i in 1 2 3 4 5 6; do pick_port 20000 22700 10000; ports+=("$PORT"); done
    for p in "${ports[@]}"; do
        redis_write_conf "$dir" "$p"
        redis_start_one "$dir" "$p"
        addrs+=("127.0.0.1:$p")
    done
    for p in "${ports[@]}"; do
        wait_until redis 20 redis_ping "$p" || die "redis-server on $p did not start (see $(redis_conf_dir "$dir" "$p")/redis.log)"
    done
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes \
        >"$dir/redis/create.log" 2>&1 || die "redis-cli --cluster create failed (see $dir/redis/create.log)"
    for p in "${ports[@]}"; do
        wait_until redis 60 redis_node_ready "$p" || die "redis node $p not ready within 60s (cluster info: $(redis-cli -p "$p" cluster info | tr -d '\r' | head -n 3 | tr '\n' ' '))"
    done
    # masters in port order; REDIS_CLUSTER_REPLICAS[i] replicates REDIS_CLUSTER_MASTERS[i]
    nodes=$(redis-cli -p "${ports[0]}" cluster nodes | tr -d '\r' | sed 's/myself,//')
    for p in $(printf '%s\n' "${ports[@]}" | sort -n); do
        line=$(grep " 127.0.0.1:$p@" <<<"$nodes" | grep ' master ') || continue
        masters+=("127.0.0.1:$p")
        line=$(awk -v id="${line%% *}" '$3 == "slave" && $4 == id {print $2}' <<<"$nodes")
        [ -n "$line" ] || die "master 127.0.0.1:$p has no replica"
        replicas+=("${line%@*}")
    done
    [ ${#masters[@]} = 3 ] && [ ${#replicas[@]} = 3 ] || die "unexpected cluster layout: masters ${masters[*]}, replicas ${replicas[*]}"
    {
        echo "REDIS_CLUSTER_NODES=$(IFS=,; echo "${addrs[*]}")"
        echo "REDIS_CLUSTER_MASTERS=$(IFS=,; echo "${masters[*]}")"
        echo "REDIS_CLUSTER_REPLICAS=$(IFS=,; echo "${replicas[*]}")"
        echo "REDIS_CLUSTER_DIR=$dir/redis"
    } >>"$dir/env.new"
}

redis_ports_of() { # DIR -> the ports of its redis nodes (from DIR/redis/*/redis.conf)
    local c
    for c in "$1"/redis/*/redis.conf; do
        [ -f "$c" ] && basename "$(dirname "$c")"
    done
    return 0
}

redis_stop_one() { # DIR PORT SIGNAL
    local pid
    pid=$(redis_pid "$1" "$2") || return 0
    kill "-$3" "$pid" 2>/dev/null || true
    wait_until "" 10 sh -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid" 2>/dev/null || true
    wait_until "" 5 sh -c "! kill -0 $pid 2>/dev/null" || true
}

redis_down() { # DIR
    local p
    for p in $(redis_ports_of "$1"); do redis_stop_one "$1" "$p" TERM & done
    wait
}

redis_kill_cmd() { # DIR PORT
    local dir=$1 p=$2 pid
    [ -f "$(redis_conf_dir "$dir" "$p")/redis.conf" ] || die "$p is not a redis port of $dir"
    pid=$(redis_pid "$dir" "$p") || { say "redis $p is not running"; return 0; }
    kill -KILL "$pid"
    wait_until "" 10 sh -c "! kill -0 $pid 2>/dev/null" || die "redis $p (pid $pid) did not die"
    say "redis $p killed (pid $pid)"
}

redis_start_cmd() { # DIR PORT
    local dir=$1 p=$2
    redis_start_one "$dir" "$p"
    wait_until redis 20 redis_ping "$p" || die "redis-server on $p did not start"
    wait_until redis 60 redis_node_ready "$p" || die "redis $p did not rejoin within 60s"
    say "redis $p is back ($(redis-cli -p "$p" role | head -n 1 | tr -d '\r'))"
}

# ---------------------------------------------------------------- rabbitmq

rnode_dir() { echo "$1/rabbit/node$2"; }

# Exports node N's environment (from its node.env) into the current shell:
# call in a subshell.
rabbit_env() { # DIR N
    local f line
    f="$(rnode_dir "$1" "$2")/node.env"
    [ -f "$f" ] || die "no $f: no RabbitMQ node $2 in $1"
    while IFS= read -r line; do
        case "$line" in ''|'#'*) continue ;; esac
        export "${line%%=*}=${line#*=}"
    done <"$f"
}

rnode_name() { # DIR N
    sed -n 's/^RABBITMQ_NODENAME=//p' "$(rnode_dir "$1" "$2")/node.env"
}

rctl() { # DIR N ARGS... : rabbitmqctl against node N, with its env (cookie)
    local dir=$1 n=$2
    shift 2
    (rabbit_env "$dir" "$n"; cd "$(rnode_dir "$dir" "$n")"; "$RBIN/rabbitmqctl" -n "$RABBITMQ_NODENAME" "$@")
}

# The pid of node N's Erlang VM if it runs: from rabbit's pid file or the
# launcher's, checked against the process's environment (its node name).
rnode_pid() { # DIR N
    local d pid name
    d=$(rnode_dir "$1" "$2")
    name=$(rnode_name "$1" "$2")
    for pid in $(cat "$d/rabbit.pid" 2>/dev/null) $(rnode_vm_pids "$d" "$name"); do
        if [ -r "/proc/$pid/environ" ] && tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qx "RABBITMQ_NODENAME=$name" \
            && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q beam; then
            echo "$pid"
            return 0
        fi
    done
    return 1
}

rnode_vm_pids() { # NODEDIR NAME -> beam processes of that node (children of its launcher)
    local lpid
    lpid=$(cat "$1/launch.pid" 2>/dev/null) || return 0
    [ -n "$lpid" ] && pgrep -P "$lpid" 2>/dev/null || true
    echo "$lpid"
}

rnode_launch() { # DIR N
    local dir=$1 n=$2 d
    d=$(rnode_dir "$dir" "$n")
    rm -f "$d/rabbit.pid"
    (
        rabbit_env "$dir" "$n"
        cd "$d"
        # its own session, so a ^C to `make test` does not reach it; stopped by `down`
        setsid "$RBIN/rabbitmq-server" </dev/null >>"$d/stdout.log" 2>&1 &
        echo $! >"$d/launch.pid"
    )
}

rnode_alive() { rnode_pid "$1" "$2" >/dev/null; }

rnode_amqp_ready() { # DIR N: VM alive and AMQP port accepting
    local p
    p=$(sed -n 's/^RABBITMQ_NODE_PORT=//p' "$(rnode_dir "$1" "$2")/node.env")
    port_open "$p"
}

rnode_wait_amqp() { # DIR N SECONDS
    local dir=$1 n=$2 end
    end=$(($(now) + $3))
    while ! rnode_amqp_ready "$dir" "$n"; do
        if [ "$(now)" -ge "$end" ]; then
            die "RabbitMQ node $n not serving AMQP within $3s (see $(rnode_dir "$dir" "$n")/log)"
        fi
        # the launcher exits when the VM does: a failed boot
        if ! kill -0 "$(cat "$(rnode_dir "$dir" "$n")/launch.pid")" 2>/dev/null; then
            tail -n 20 "$(rnode_dir "$dir" "$n")/stdout.log" >&2 || true
            die "RabbitMQ node $n exited during boot (see $(rnode_dir "$dir" "$n")/log)"
        fi
        sleep 0.3
    done
}

running_nodes() { # DIR N -> running node names as node N sees them, one a line
    rctl "$1" "$2" -q cluster_status --formatter json 2>/dev/null \
        | sed -n 's/.*"running_nodes":\[\([^]]*\)\].*/\1/p' | tr ',' '\n' | tr -d '"' | sed '/^$/d'
}

# Node N sees itself and every node whose VM is alive as running.
rnode_in_cluster() { # DIR N
    local dir=$1 n=$2 seen m
    seen=$(running_nodes "$dir" "$n") || return 1
    for m in 1 2 3; do
        [ -d "$(rnode_dir "$dir" "$m")" ] || continue
        if [ "$m" = "$n" ] || rnode_alive "$dir" "$m"; then
            grep -qx "$(rnode_name "$dir" "$m")" <<<"$seen" || return 1
        fi
    done
}

rabbit_write_node() { # DIR N NAME AMQP DIST
    local dir=$1 n=$2 name=$3 amqp=$4 dist=$5 d r
    r="$dir/rabbit"
    d=$(rnode_dir "$dir" "$n")
    mkdir -p "$d/mnesia" "$d/log"
    cat >"$d/rabbitmq.conf" <<EOF
# clusters.sh: private RabbitMQ node $name
listeners.tcp.default = 127.0.0.1:$amqp
loopback_users = none
# management is not enabled (see enabled_plugins); nothing else listens
log.file.level = info
log.console = false
disk_free_limit.absolute = 50MB
EOF
    # As docs/operations.md recommends for a cluster: a quorum queue's
    # at-least-once dead-letter forwarder retries a message its target
    # refused after this long (default 180 s). A delay tier whose new leader
    # starts forwarding before the work queues have elected theirs (their
    # node stopped together) otherwise holds the expired copies 3-6 minutes.
    cat >"$d/advanced.config" <<EOF
[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].
EOF
    cat >"$d/node.env" <<EOF
HOME=$r/home
RABBITMQ_CONF_ENV_FILE=$r/rabbitmq-env.conf
RABBITMQ_NODENAME=$name
RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
RABBITMQ_NODE_PORT=$amqp
RABBITMQ_DIST_PORT=$dist
RABBITMQ_MNESIA_BASE=$d/mnesia
RABBITMQ_LOG_BASE=$d/log
RABBITMQ_PID_FILE=$d/rabbit.pid
RABBITMQ_CONFIG_FILE=$d/rabbitmq.conf
RABBITMQ_CONFIG_FILES=$d/conf.d/*.conf
RABBITMQ_ADVANCED_CONFIG_FILE=$d/advanced.config
RABBITMQ_ENABLED_PLUGINS_FILE=$r/enabled_plugins
RABBITMQ_MOTD_FILE=$d/motd
EOF
}

rabbit_up() { # DIR
    local dir=$1 r suffix n names=() amqps=() dists=() urls=() files=() p
    [ -n "$RBIN" ] || die "rabbitmq-server is not installed (Debian: apt-get install rabbitmq-server)"
    r="$dir/rabbit"
    mkdir -p "$r/home"
    # one cookie for the three nodes and their CLI, in a private HOME
    (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F | head -c 32 >"$r/home/.erlang.cookie")
    chmod 400 "$r/home/.erlang.cookie"
    echo "[$PLUGIN]." >"$r/enabled_plugins"
    cat >"$r/rabbitmq-env.conf" <<EOF
# clusters.sh: used instead of /etc/rabbitmq/rabbitmq-env.conf (the shared
# node's); like it, distribution on 127.0.0.1 only
ERL_EPMD_ADDRESS=127.0.0.1
SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    suffix=$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')
    for n in 1 2 3; do
        names+=("tgc$n-$suffix@$RABBIT_HOST")
        pick_port 23000 25600; amqps+=("$PORT")
        pick_port 26000 29000; dists+=("$PORT")
        rabbit_write_node "$dir" "$n" "${names[-1]}" "${amqps[-1]}" "${dists[-1]}"
        urls+=("amqp://guest:guest@127.0.0.1:${amqps[-1]}/%2f")
        files+=("$(rnode_dir "$dir" "$n")/node.env")
    done
    # boot the three VMs side by side (each first as a cluster of one)
    for n in 1 2 3; do rnode_launch "$dir" "$n"; done
    {
        echo "RABBIT_NODES=$(IFS=,; echo "${names[*]}")"
        echo "RABBIT_AMQP_PORTS=$(IFS=,; echo "${amqps[*]}")"
        echo "RABBIT_AMQP_URLS=$(IFS=,; echo "${urls[*]}")"
        echo "RABBIT_DIST_PORTS=$(IFS=,; echo "${dists[*]}")"
        echo "RABBIT_HOME=$r/home"
        echo "RABBIT_BIN=$RBIN"
        echo "RABBIT_NODE_ENV_FILES=$(IFS=,; echo "${files[*]}")"
        echo "RABBIT_CLUSTER_DIR=$r"
    } >>"$dir/env.new"
}

rctl_2_and_3() { # DIR ARGS... : rabbitmqctl ARGS on nodes 2 and 3 at once
    local dir=$1 p2 p3
    shift
    rctl "$dir" 2 "$@" >/dev/null & p2=$!
    rctl "$dir" 3 "$@" >/dev/null & p3=$!
    wait "$p2" || die "rabbitmqctl $* failed on node 2"
    wait "$p3" || die "rabbitmqctl $* failed on node 3"
}

rabbit_form() { # DIR: after rabbit_up and the redis part, join 2 and 3 to 1
    local dir=$1 n node1
    node1=$(rnode_name "$dir" 1)
    for n in 1 2 3; do rnode_wait_amqp "$dir" "$n" 120; done
    # stop_app / start_app of 2 and 3 side by side; the joins one at a time
    rctl_2_and_3 "$dir" -q stop_app
    for n in 2 3; do
        rctl "$dir" "$n" -q join_cluster "$node1" >/dev/null || die "node $n could not join $node1"
    done
    rctl_2_and_3 "$dir" -q start_app
    for n in 1 2 3; do rnode_wait_amqp "$dir" "$n" 60; done
    wait_until rabbit 60 rnode_in_cluster "$dir" 1 || die "the RabbitMQ cluster did not form: $(running_nodes "$dir" 1 | tr '\n' ' ')"
}

rnode_stop() { # DIR N SIGNAL
    local dir=$1 n=$2 sig=$3 pid lpid
    lpid=$(cat "$(rnode_dir "$dir" "$n")/launch.pid" 2>/dev/null || true)
    if pid=$(rnode_pid "$dir" "$n"); then
        # SIGTERM: the VM shuts down cleanly (like `rabbitmqctl stop`)
        kill "-$sig" "$pid" 2>/dev/null || true
        wait_until "" 60 sh -c "! kill -0 $pid 2>/dev/null" || kill -KILL "$pid" 2>/dev/null || true
        wait_until "" 10 sh -c "! kill -0 $pid 2>/dev/null" || true
    fi
    # the launcher (rabbitmq-server's shell) exits with the VM; make sure
    if [ -n "$lpid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$lpid/cmdline" | grep -q rabbitmq-server; then
        wait_until "" 5 sh -c "! kill -0 $lpid 2>/dev/null" || kill -KILL "$lpid" 2>/dev/null || true
    fi
    rm -f "$(rnode_dir "$dir" "$n")/rabbit.pid"
}

rabbit_down() { # DIR
    local n
    for n in 1 2 3; do
        [ -f "$(rnode_dir "$1" "$n")/node.env" ] || continue
        rnode_stop "$1" "$n" TERM &
    done
    wait
}

rabbit_stop_cmd() { # DIR N SIGNAL
    local dir=$1 n=$2
    rnode_alive "$dir" "$n" || { say "RabbitMQ node $n is not running"; return 0; }
    rnode_stop "$dir" "$n" "$3"
    rnode_alive "$dir" "$n" && die "RabbitMQ node $n is still running"
    say "RabbitMQ node $n ($(rnode_name "$dir" "$n")) stopped"
}

rabbit_start_cmd() { # DIR N
    local dir=$1 n=$2
    if ! rnode_alive "$dir" "$n"; then
        rnode_launch "$dir" "$n"
    fi
    rnode_wait_amqp "$dir" "$n" 120
    wait_until rabbit 60 rnode_in_cluster "$dir" "$n" || die "RabbitMQ node $n did not rejoin: $(running_nodes "$dir" "$n" | tr '\n' ' ')"
    say "RabbitMQ node $n ($(rnode_name "$dir" "$n")) is back; running: $(running_nodes "$dir" "$n" | tr '\n' ' ')"
}

# ---------------------------------------------------------------- commands

check_n() { case "${1:-}" in 1|2|3) ;; *) die "node number must be 1, 2 or 3, not '${1:-}'" ;; esac; }

down_cmd() { # DIR
    local dir=$1
    [ -d "$dir" ] || return 0
    redis_down "$dir" &
    rabbit_down "$dir" &
    wait
    return 0
}

up_cmd() { # DIR [--redis-only|--rabbit-only]
    local dir=$1 what=${2:-both} t0
    case "$what" in both|--redis-only|--rabbit-only) ;; *) die "unknown flag $what" ;; esac
    t0=$(now)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    # an earlier cluster here: stop it, wipe its state (only our subdirectories)
    down_cmd "$dir"
    rm -rf "$dir/redis" "$dir/rabbit" "$dir/env" "$dir/env.new"
    mkdir -p "$dir/redis" "$dir/rabbit"
    # if anything fails, leave nothing running
    trap 'st=$?; if [ $st != 0 ]; then say "up failed: stopping what was started"; down_cmd "'"$dir"'"; fi' EXIT
    {
        echo "CLUSTERS_DIR=$dir"
        echo "CLUSTERS_SCRIPT=$SELF"
    } >"$dir/env.new"
    if [ "$what" != --redis-only ]; then rabbit_up "$dir"; fi   # VMs boot while Redis is set up
    if [ "$what" != --rabbit-only ]; then
        redis_up "$dir"
        say "redis cluster ready after $(($(now) - t0))s"
    fi
    if [ "$what" != --redis-only ]; then
        rabbit_form "$dir"
        say "rabbitmq cluster ready after $(($(now) - t0))s"
    fi
    mv "$dir/env.new" "$dir/env"
    trap - EXIT
    say "up in $(($(now) - t0))s; settings in $dir/env"
}

cmd=${1:-}
[ $# -ge 2 ] || die "usage: $0 up|down|rabbit-stop|rabbit-kill|rabbit-start|redis-kill|redis-start|rabbitmqctl DIR [N|PORT|flag]"
DIR=$2
case "$cmd" in
    up) up_cmd "$DIR" "${3:-both}" ;;
    down)
        [ -d "$DIR" ] && DIR=$(cd "$DIR" && pwd)
        down_cmd "$DIR"
        say "down: $DIR stopped"
        ;;
    rabbit-stop) check_n "${3:-}"; rabbit_stop_cmd "$(cd "$DIR" && pwd)" "$3" TERM ;;
    rabbit-kill) check_n "${3:-}"; rabbit_stop_cmd "$(cd "$DIR" && pwd)" "$3" KILL ;;
    rabbit-start) check_n "${3:-}"; rabbit_start_cmd "$(cd "$DIR" && pwd)" "$3" ;;
    redis-kill) redis_kill_cmd "$(cd "$DIR" && pwd)" "${3:?PORT}" ;;
    redis-start) redis_start_cmd "$(cd "$DIR" && pwd)" "${3:?PORT}" ;;
    rabbitmqctl) check_n "${3:-}"; DIR=$(cd "$DIR" && pwd); n=$3; shift 3; rctl "$DIR" "$n" "$@" ;;
    *) die "unknown command '$cmd'" ;;
esac
