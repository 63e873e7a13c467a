#!/usr/bin/env bash
# A CPU hog beside the test suite: one busy loop per core, the load a developer's laptop or a shared CI runner puts
# beside it (docs/measurements.md records the suite's time with and without it).
#   bash scripts/cpu_hog.sh start [N]   start N busy loops (default: one per core)
#   bash scripts/cpu_hog.sh stop        stop the loops `start` started, by PID
#   bash scripts/cpu_hog.sh status      list them
# The loops' PIDs are kept in $CPU_HOG_PIDS (default /tmp/openrlhf-tis-cpu-hog.pids) with each one's start time, so a
# PID the kernel has since given to another process is never signalled.
set -euo pipefail
PIDS=${CPU_HOG_PIDS:-/tmp/openrlhf-tis-cpu-hog.pids}

started_at() {  # field 22 of /proc/PID/stat (the process's start time), read past the command name
  sed -E 's/^.*\) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'
}

ours() {  # the PIDs in $PIDS still running as the loops we started
  [[ -f $PIDS ]] || return 0
  while read -r pid when; do
    if [[ -n $pid && "$(started_at "$pid")" == "$when" ]]; then echo "$pid"; fi
  done < "$PIDS"
}

case "${1:-}" in
  start)
    count=${2:-$(nproc)}
    if [[ ! $count =~ ^[1-9][0-9]*$ ]]; then
      echo "cpu_hog.sh: error: N must be a whole number >= 1, got '$count'" >&2; exit 2
    fi
    running=$(ours | tr '\n' ' ')
    if [[ -n $running ]]; then
      echo "cpu_hog.sh: error: already running (PIDs ${running% }); stop them first" >&2; exit 2
    fi
    : > "$PIDS"
    for _ in $(seq "$count"); do
      nohup bash -c 'while :; do :; done' > /dev/null 2>&1 &
      echo "$! $(started_at $!)" >> "$PIDS"
    done
    echo "cpu_hog.sh: $count busy loop(s) started, PIDs $(cut -d' ' -f1 "$PIDS" | tr '\n' ' ')(in $PIDS)"
    ;;
  stop)
    pids=$(ours)
    for pid in $pids; do kill "$pid" 2> /dev/null || true; done
    for _ in $(seq 50); do
      [[ -z $(ours) ]] && break
      sleep 0.1
    done
    rm -f "$PIDS"
    echo "cpu_hog.sh: stopped $(echo $pids | wc -w) busy loop(s)"
    ;;
  status)
    pids=$(ours | tr '\n' ' ')
    echo "cpu_hog.sh: ${pids:-none running}"
    ;;
  *)
    echo "usage: bash scripts/cpu_hog.sh start [N] | stop | status" >&2; exit 2
    ;;
esac
