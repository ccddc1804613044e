#!/usr/bin/env bash
# Launch GRPO training; every argument is a Hydra override (or --config-name NAME):
#   bash launch/run_main_grpo.sh runner.max_steps=20 actor.num_workers=2
# With a Ray cluster running (`ray start`, or RAY_ADDRESS) the driver joins it; otherwise it starts
# an embedded local Ray.
#
# If the driver dies (exit code 1, or killed), it is relaunched with runner.resume_dir=auto, up to
# RLRUNNER_MAX_RESTARTS times (default 3; 0 = never), after RLRUNNER_RESTART_BACKOFF_S seconds
# (default 10, doubling each time, at most RLRUNNER_RESTART_BACKOFF_MAX_S, default 300). The other
# exit codes end it (the `case` below; what each means: `python -m rlrunner.main_grpo --help`, from
# rlrunner/errors.py, which a test checks this script against). SIGTERM / SIGINT sent to this script
# are passed on to the driver, which saves and exits; a second one makes it exit at once.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}"
python="${PYTHON:-python}"
max_restarts="${RLRUNNER_MAX_RESTARTS:-3}"
backoff="${RLRUNNER_RESTART_BACKOFF_S:-10}"
backoff_max="${RLRUNNER_RESTART_BACKOFF_MAX_S:-300}"

say() { echo "run_main_grpo.sh: $*" >&2; }

args=("$@")
with_auto_resume() {  # the arguments with any runner.resume_dir replaced by runner.resume_dir=auto
    local kept=() arg
    for arg in "${args[@]}"; do
        case "$arg" in runner.resume_dir=*|+runner.resume_dir=*|++runner.resume_dir=*) ;; *) kept+=("$arg") ;; esac
    done
    args=("${kept[@]}" "runner.resume_dir=auto")
}

child=""
stopping=""
forward() {  # pass a stop on to the driver once; the driver decides what a second one means
    stopping=1
    if [ -n "$child" ]; then kill -s "$1" "$child" 2>/dev/null; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
set -m  # the driver gets its own process group: a terminal's Ctrl-C reaches it once, through forward()

restarts=0
while true; do
    "$python" -m rlrunner.main_grpo "${args[@]}" &
    child=$!
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do  # a forwarded signal interrupted `wait`: the driver is still saving
        rc=0
        wait "$child" || rc=$?
    done
    child=""
    case "$rc" in
        0) say "the run finished"; exit 0 ;;
        2) say "configuration error (exit code 2): not restarting"; exit 2 ;;
        3) say "stopped on request after an emergency checkpoint (exit code 3): resume with runner.resume_dir=auto"; exit 3 ;;
        4) say "failed in a way a relaunch cannot mend (exit code 4): not restarting"; exit 4 ;;
    esac
    if [ -n "$stopping" ]; then
        say "stopped by a signal (driver exit code $rc): not restarting"
        exit "$rc"
    fi
    if [ "$restarts" -ge "$max_restarts" ]; then
        say "the driver exited with code $rc and RLRUNNER_MAX_RESTARTS=$max_restarts restarts are used up: giving up"
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    say "the driver exited with code $rc: restart $restarts of $max_restarts with runner.resume_dir=auto in ${backoff}s"
    sleep "$backoff" &
    wait $! || true
    if [ -n "$stopping" ]; then say "stopped by a signal during the back-off: not restarting"; exit 143; fi
    backoff=$(( backoff * 2 > backoff_max ? backoff_max : backoff * 2 ))
    with_auto_resume
done
