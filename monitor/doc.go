// Package monitor reads the figures an operator watches from the database,
// and publishes them as OpenTelemetry observable gauges:
//
//	atomicphase.outbox.pending             {message}  messages neither published nor dead-lettered
//	atomicphase.outbox.oldest_pending.age  s          how long ago the oldest of them was staged
//	atomicphase.outbox.dead                {message}  dead-lettered messages kept (until retention)
//	atomicphase.keys.stalled               {key}      running keys with a free or expired lease,
//	                                                  idle longer than Config.StalledAfter
//
// [Read] returns them (and a few more, for status pages) in one statement;
// [RegisterGauges] registers the gauges with a MeterProvider (the global
// one by default) and reads them at each collection. Each figure comes from
// a partial index that holds only the rows it counts, so the cost of a read
// grows with the backlog, not with the tables (the plans are checked by
// this package's tests).
//
// The figures are the database's: every process reads the same ones.
// Register the gauges in one process per database (cmd/reaper does, with
// -http), or aggregate with max() rather than sum().
//
// The package uses the OpenTelemetry API only; the service chooses the
// SDK and exporter.
package monitor
