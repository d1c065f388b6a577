// Command atomicphase is the admin command for an atomicphase installation:
// inspect idempotency keys, fail a stuck one, watch and redrive the outbox,
// and export the migrations for the goose CLI.
//
//	atomicphase keys show SCOPE KEY              a key's timeline: created, phases with their results,
//	                                             attempts, lease, response, the messages it staged
//	atomicphase keys stalled [--after 1m]        keys a Resumer would resume or fail, oldest first
//	atomicphase keys fail SCOPE KEY --reason R   fail a running key: retries get a stored 500
//	atomicphase outbox status                    pending and dead-lettered messages, per topic
//	atomicphase outbox dead [--topic T]          the newest dead letters with their errors
//	atomicphase outbox redrive ID...             dead letters back to pending (row ids or message ids)
//	atomicphase outbox redrive --all [--topic T]
//	atomicphase migrations export DIR            the embedded SQL files, for goose -dir DIR
//
// Every command takes --database-url (default $DATABASE_URL) and --json,
// which prints JSON instead of tables, for scripts. Flags may come before
// or after the arguments; "--" ends them (for a scope that starts with a
// dash).
//
// The two writes, keys fail and outbox redrive, show what they will change
// and ask for confirmation on standard input, unless --yes is given. Each
// writes an audit line (JSON, msg "atomicphase audit": who, where, what,
// and what it was before) on standard error.
//
// Stored text (scopes, errors, bodies) is printed with control characters
// escaped, so a hostile value cannot drive the terminal.
//
// Exit status: 0 done, 1 failure (the database unreachable, a key or
// message not found or not in a state the command acts on, a write not
// confirmed), 2 usage error (unknown command or flag, a malformed key or
// id, a missing argument). Errors are one line on standard error.
package main
