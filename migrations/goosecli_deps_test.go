package migrations_test

// The tests build the goose CLI (github.com/pressly/goose/v3/cmd/goose) at
// the goose version in go.mod, with only its PostgreSQL driver (see
// buildGoose). These are the CLI's imports beyond goose and pgx; importing
// them here keeps them, at the versions goose requires, in go.mod and
// go.sum, so that the build needs nothing beyond the module cache.
import (
	_ "github.com/joho/godotenv"
	_ "github.com/mfridman/xflag"
)
