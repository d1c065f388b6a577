// Command reaper resumes or fails stalled idempotency keys and deletes
// expired keys and outbox messages: the recovery and cleanup packages behind
// a command line, for cron (-once) or as a daemon (-interval D).
//
//	reaper -once                       # one round, for cron or a Kubernetes CronJob
//	reaper -interval 1m                # a round every minute until SIGTERM or SIGINT
//	reaper -once -dry-run              # report what a round would do; change nothing
//	reaper -interval 1m -http :9090    # a daemon serving /metrics, /healthz and a status page
//
// Settings come from flags, with environment variables as their defaults:
// -database-url ($DATABASE_URL), -ttl ($REAPER_TTL), -outbox-retention
// ($REAPER_OUTBOX_RETENTION), -tombstone-retention
// ($REAPER_TOMBSTONE_RETENTION), -resume-delay ($REAPER_RESUME_DELAY),
// -max-attempts ($REAPER_MAX_ATTEMPTS), -max-age ($REAPER_MAX_AGE: the
// txn.Config.MaxAge of the runner the reaper works through; give it the
// services' value), -unknown-workflow-delay ($REAPER_UNKNOWN_WORKFLOW_DELAY),
// -batch-size ($REAPER_BATCH_SIZE, for recovery and cleanup alike),
// -cleanup-pause ($REAPER_CLEANUP_PAUSE, cleanup.Config.BatchPause),
// -log-level ($REAPER_LOG_LEVEL) and -http ($REAPER_HTTP, off). Their
// defaults are the packages' own (cleanup.TTLDefault, cleanup.OutboxRetentionDefault,
// cleanup.TombstoneRetentionDefault, recovery.ResumeDelayDefault, recovery.MaxAttemptsDefault,
// txn.MaxAgeDefault, recovery.UnknownWorkflowDelayDefault,
// cleanup.BatchSizeDefault, cleanup.BatchPauseDefault); reaper -help prints them.
//
// Logs are JSON lines on standard error, one summary line per round
// (msg "reaper round", or "reaper dry run"), which ends with the outbox
// backlog: outbox_pending messages and outbox_oldest_pending_age.
//
// With -http ADDR (interval mode only) the reaper serves, on ADDR:
//
//	/metrics  the OpenTelemetry metrics of this process in the Prometheus
//	          text format: the gauges of package monitor (outbox backlog,
//	          oldest pending age, dead letters, stalled keys), the rounds'
//	          counts (resumed, failed stalled keys by reason, keys and
//	          messages deleted, skipped cleanups), Go runtime and process
//	          metrics;
//	/healthz  200 when the database answers and has every migration, 503
//	          otherwise, with a JSON body saying which;
//	/         a read-only status page: the figures above, the outbox per
//	          topic, the last 20 failed keys with their reasons, the last 20
//	          dead letters, and the last round. It is one server-rendered
//	          document with no script and no external resource.
//
// The exit status is 0 when every round succeeded or the reaper was
// stopped by SIGTERM or SIGINT (a stop lets the batch in flight commit and
// starts no other), 1 when a round failed or the database is unreachable
// or its schema is behind (the message names the first missing migration),
// and 2 for a usage error.
//
// This binary has no user code, so its workflow registry is empty: it
// cannot resume anything, and fails stalled keys once they are older than
// -unknown-workflow-delay (and those past -max-attempts or -max-age). A
// service that wants its stalled keys resumed runs recovery.Resumer with its
// own registry, in-process or in a service-specific reaper built the same way.
package main
