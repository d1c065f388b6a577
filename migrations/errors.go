package migrations

import "errors"

// Sentinel errors, matched with errors.Is. The package returns them wrapped
// with its name and the operation ("migrations: check: database schema is
// behind: ..."), so their own text carries neither.
var (
	// ErrSchemaBehind reports that the database lacks migrations this build
	// needs. Check and Up name the first missing file.
	ErrSchemaBehind = errors.New("database schema is behind")

	// ErrWrongVersionTable reports atomicphase's tables in a schema whose
	// atomicphase_goose_db_version does not record them: the goose CLI
	// applied the migrations without -table atomicphase_goose_db_version
	// (into goose_db_version, the host application's table). The error
	// names both tables and the flag.
	ErrWrongVersionTable = errors.New("migrations recorded in another version table")

	// ErrDataLossRefused reports a down migration that would have deleted
	// rows, refused because the operator did not opt in with
	// [AllowDataLoss] (or atomicphase.allow_data_loss = on for the goose CLI).
	// Nothing was rolled back.
	ErrDataLossRefused = errors.New("rollback refused: it would delete rows")
)
