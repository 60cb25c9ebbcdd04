# Shared by the GPU session scripts (source it after setting LOG): `say` prints a
# timestamped line into the log; `part NAME SECONDS COMMAND...` runs COMMAND under
# `timeout`, its output tee'd into the log, and says how it ended.

say() { echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

part() {
    local name=$1 cap=$2
    shift 2
    local cmd="$*"
    say "$name (cap ${cap} s): ${cmd:0:300}"
    local start=$SECONDS
    timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "$name: exit $rc after $((SECONDS - start)) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
}
