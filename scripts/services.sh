# Sourced by scripts/test: make sure the services the tests need are installed and running.
# Each ensure_* installs (Debian packages) when missing, starts when down, and waits until the
# service answers — or fails loudly.

PG_HOST=127.0.0.1
PG_PORT=5432

say() { printf '[services] %s\n' "$*" >&2; }

# Stops what the functions below started (a tansu they ran); scripts/test calls it on exit.
services_cleanup() { if [ -n "${TANSU_PID:-}" ]; then kill "$TANSU_PID" 2>/dev/null || true; fi; }
trap services_cleanup EXIT
die() { printf '[services] FAILED: %s\n' "$*" >&2; exit 1; }

wait_for() { # wait_for DESCRIPTION SECONDS COMMAND...
  local what=$1 seconds=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "$what did not become ready within ${seconds}s"
    sleep 1
  done
}

apt_install() {
  command -v apt-get >/dev/null || die "cannot install $* here: no apt-get"
  say "installing $*"
  if [ -z "${APT_UPDATED:-}" ]; then apt-get update -qq >&2; APT_UPDATED=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

ensure_postgres() {
  if [ -n "${DATABASE_URL:-}" ] && [ "${INBOX_START_SERVICES:-1}" = 0 ]; then return; fi
  if ! pg_isready -h "$PG_HOST" -p "$PG_PORT" -q 2>/dev/null; then
    if ! command -v pg_ctlcluster >/dev/null; then
      apt_install postgresql postgresql-client
    fi
    local version
    version=$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)
    [ -n "$version" ] || die "PostgreSQL is installed but has no cluster under /etc/postgresql"
    say "starting PostgreSQL $version"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start >&2 || true
    wait_for "PostgreSQL on $PG_HOST:$PG_PORT" 60 pg_isready -h "$PG_HOST" -p "$PG_PORT"
  fi
  # The tests connect as postgres without a password to database `test`.
  if ! psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d test -Atqc 'SELECT 1' >/dev/null 2>&1; then
    psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -qc 'CREATE DATABASE test' >&2 \
      || die "cannot reach PostgreSQL as user postgres at $PG_HOST:$PG_PORT (trust auth expected)"
  fi
  export DATABASE_URL="${DATABASE_URL:-postgres://postgres@$PG_HOST:$PG_PORT/test}"
  # Scenario databases of earlier runs.
  psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -Atqc \
    "SELECT datname FROM pg_database WHERE datname LIKE 'inbox\_t\_%'" 2>/dev/null |
    while read -r db; do psql -h "$PG_HOST" -p "$PG_PORT" -U postgres -d postgres -qc "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true; done
  say "PostgreSQL ready"
}

MYSQL_HOST=127.0.0.1
MYSQL_PORT=3306

mysql_ping() { mysqladmin --protocol=tcp -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root ping; }

# MariaDB from Debian's packages (MySQL 8 is not packaged there; with a Docker engine and no
# MYSQL_URL the tests start a MySQL 8 container instead). No systemd: mariadbd is started
# detached as the mysql user, as the harness's restart test does.
ensure_mariadb() {
  if [ -n "${MYSQL_URL:-}" ] && [ "${INBOX_START_SERVICES:-1}" = 0 ]; then return; fi
  if ! mysql_ping >/dev/null 2>&1; then
    if [ ! -x /usr/sbin/mariadbd ] || ! command -v mysqladmin >/dev/null; then
      apt_install mariadb-server mariadb-client
    fi
    say "starting MariaDB"
    install -d -o mysql -g mysql /run/mysqld
    setsid -f /usr/sbin/mariadbd --user=mysql </dev/null >/dev/null 2>&1
    wait_for "MariaDB on $MYSQL_HOST:$MYSQL_PORT" 60 mysql_ping
  fi
  # The tests connect as root without a password over TCP, to database `test`.
  mysql --protocol=tcp -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -e 'CREATE DATABASE IF NOT EXISTS test' >&2 \
    || die "cannot reach MariaDB as root without a password at $MYSQL_HOST:$MYSQL_PORT"
  export MYSQL_URL="${MYSQL_URL:-mysql://root@$MYSQL_HOST:$MYSQL_PORT/test}"
  # Scenario databases of earlier runs.
  mysql --protocol=tcp -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -N -e \
    "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'inbox\\_t\\_%'" 2>/dev/null |
    while read -r db; do mysql --protocol=tcp -h "$MYSQL_HOST" -P "$MYSQL_PORT" -u root -e "DROP DATABASE IF EXISTS \`$db\`" >/dev/null 2>&1 || true; done
  say "MariaDB ready"
}

AMQP_HOST=127.0.0.1
AMQP_PORT=5672

amqp_port_open() { (exec 3<>"/dev/tcp/$AMQP_HOST/$AMQP_PORT") 2>/dev/null; }

ensure_rabbitmq() {
  if ! amqp_port_open; then
    if ! command -v rabbitmq-server >/dev/null; then
      apt_install rabbitmq-server
    fi
    say "starting RabbitMQ"
    rabbitmq-server -detached >&2 || true
    wait_for "RabbitMQ on $AMQP_HOST:$AMQP_PORT" 120 amqp_port_open
  fi
  wait_for "RabbitMQ to answer rabbitmqctl" 120 rabbitmqctl -q status
  # rabbitmqadmin (a client other than ours, used by the tests) talks to the management plugin.
  if ! rabbitmqadmin -q list vhosts >/dev/null 2>&1; then
    if ! command -v rabbitmqadmin >/dev/null; then apt_install rabbitmq-server; fi
    say "enabling the RabbitMQ management plugin"
    rabbitmq-plugins enable rabbitmq_management >&2
    wait_for "the RabbitMQ management API" 60 rabbitmqadmin -q list vhosts
  fi
  export AMQP_URL="${AMQP_URL:-amqp://guest:guest@$AMQP_HOST:$AMQP_PORT/%2f}"
  say "RabbitMQ ready"
}

KAFKA_HOST=127.0.0.1
KAFKA_PORT=9092

kafka_port_open() { (exec 3<>"/dev/tcp/$KAFKA_HOST/$KAFKA_PORT") 2>/dev/null; }

# tansu 0.6.0, a Kafka-API broker, from crates.io: built once into a cache (scripts/install-tansu),
# started on 127.0.0.1:9092 with its memory storage, stopped when the calling script exits.
# The harness's broker-restart test runs a tansu of its own: INBOX_TANSU names the binary.
ensure_kafka() {
  INBOX_TANSU=$(scripts/install-tansu) || die "cannot install tansu"
  export INBOX_TANSU
  if [ -n "${KAFKA_BROKERS:-}" ]; then say "using KAFKA_BROKERS=$KAFKA_BROKERS"; return; fi
  if ! kafka_port_open; then
    local tansu="$INBOX_TANSU"
    say "starting tansu (Kafka API) on $KAFKA_HOST:$KAFKA_PORT"
    TANSU_LOG="${TMPDIR:-/tmp}/inbox-tansu.log"
    "$tansu" broker --listener-url "tcp://$KAFKA_HOST:$KAFKA_PORT" \
      --advertised-listener-url "tcp://$KAFKA_HOST:$KAFKA_PORT" \
      --storage-engine memory://tansu/ >"$TANSU_LOG" 2>&1 &
    TANSU_PID=$!
    wait_for "tansu on $KAFKA_HOST:$KAFKA_PORT (log: $TANSU_LOG)" 60 kafka_port_open
  fi
  export KAFKA_BROKERS="$KAFKA_HOST:$KAFKA_PORT"
  say "Kafka API ready"
}

# A Kafka client other than ours, for the cross-client test: PyPI's confluent-kafka.
ensure_confluent_kafka() {
  if ! python3 -c 'import confluent_kafka' 2>/dev/null; then
    say "installing confluent-kafka from PyPI"
    python3 -m pip install --quiet confluent-kafka >&2 || die "cannot install confluent-kafka"
  fi
}

# An AMQP client other than ours, for messages lapin cannot even parse (a non-UTF-8 message_id):
# PyPI's pika.
ensure_pika() {
  if ! python3 -c 'import pika' 2>/dev/null; then
    say "installing pika from PyPI"
    python3 -m pip install --quiet pika >&2 || die "cannot install pika"
  fi
}

NATS_HOST=127.0.0.1
NATS_PORT=4222

nats_port_open() { (exec 3<>"/dev/tcp/$NATS_HOST/$NATS_PORT") 2>/dev/null; }

# A NATS client other than ours (the cross-client test, and the JetStream check below): PyPI's
# nats-py.
ensure_nats_py() {
  if ! python3 -c 'import nats' 2>/dev/null; then
    say "installing nats-py from PyPI"
    python3 -m pip install --quiet nats-py >&2 || die "cannot install nats-py"
  fi
}

# nats-server from Debian's packages, started as this machine kind starts it (JetStream on,
# its store under /var/lib/nats-server). The tests need JetStream: a server without it fails
# here, not in the middle of the suite.
ensure_nats() {
  if [ -n "${NATS_URL:-}" ] && [ "${INBOX_START_SERVICES:-1}" = 0 ]; then return; fi
  if ! nats_port_open; then
    if [ ! -x /usr/sbin/nats-server ] && ! command -v nats-server >/dev/null; then
      apt_install nats-server
    fi
    local server
    server=$(command -v nats-server || echo /usr/sbin/nats-server)
    say "starting nats-server with JetStream on $NATS_HOST:$NATS_PORT"
    mkdir -p /var/lib/nats-server
    setsid -f "$server" -a "$NATS_HOST" -p "$NATS_PORT" -js -sd /var/lib/nats-server \
      -l /var/log/nats-server.log </dev/null >/dev/null 2>&1
    wait_for "nats-server on $NATS_HOST:$NATS_PORT" 60 nats_port_open
  fi
  export NATS_URL="${NATS_URL:-nats://$NATS_HOST:$NATS_PORT}"
  ensure_nats_py
  # JetStream answers; the streams earlier test runs left (scenario subjects `conformance.<run>`,
  # the tests' and the harness's `<prefix>-<32 hex>`, and their dead letters) are deleted.
  python3 - "$NATS_URL" >&2 <<'PY' || die "NATS at $NATS_HOST:$NATS_PORT has no JetStream (start nats-server with -js)"
import asyncio, sys
import nats

async def main(url):
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    js = nc.jetstream()
    await js.account_info()
    import re
    ours = re.compile(r"^(conformance~2E|(slow|window|parcels|hostile|harness)-[0-9a-f]{32})")
    for name in [s.config.name for s in await js.streams_info()]:
        if ours.match(name):
            await js.delete_stream(name)
    await nc.close()

asyncio.run(main(sys.argv[1]))
PY
  say "NATS with JetStream ready"
}

REDIS_HOST=127.0.0.1
REDIS_PORT=6379

redis_ping() { redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping | grep -q PONG; }

# Redis from Debian's packages, started as this machine kind starts it (nothing kept on disk:
# the harness's Redis restart runs a server of its own with appendonly). Also PyPI's `redis`, the
# other client of the cross-client test.
ensure_redis() {
  if [ -n "${REDIS_URL:-}" ] && [ "${INBOX_START_SERVICES:-1}" = 0 ]; then return; fi
  if ! redis_ping >/dev/null 2>&1; then
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
      apt_install redis-server redis-tools
    fi
    say "starting Redis on $REDIS_HOST:$REDIS_PORT"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind "$REDIS_HOST" --port "$REDIS_PORT" --save "" \
      --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log >&2
    wait_for "Redis on $REDIS_HOST:$REDIS_PORT" 60 redis_ping
  fi
  export REDIS_URL="${REDIS_URL:-redis://$REDIS_HOST:$REDIS_PORT}"
  export INBOX_REDIS_SERVER="${INBOX_REDIS_SERVER:-$(command -v redis-server)}"
  if ! python3 -c 'import redis' 2>/dev/null; then
    say "installing redis (redis-py) from PyPI"
    python3 -m pip install --quiet redis >&2 || die "cannot install PyPI's redis"
  fi
  say "Redis ready"
}
