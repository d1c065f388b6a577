package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"github.com/atomicphase/atomicphase/migrations"
)

var migrationsExport = &command{
	name:    "migrations export",
	args:    "DIR",
	summary: "write the embedded migration files to DIR, for goose -dir DIR",
	define: func(*flag.FlagSet) func(e *env, args []string) error {
		return exportMigrations
	},
}

// exportMigrations writes every embedded migration file to the directory,
// creating it if needed. A file already there with the same bytes is left
// as it is (an applied migration is never edited, so exporting a newer
// build over an older export only adds files); one with other bytes
// stops the export before anything is written.
func exportMigrations(e *env, args []string) error {
	if len(args) != 1 || args[0] == "" {
		return fmt.Errorf("%w: want DIR, the directory to write the files to", errUsage)
	}
	dir := args[0]
	names, err := fs.Glob(migrations.FS, "*.sql")
	if err != nil {
		return err
	}
	type file struct {
		Name   string `json:"file"`
		Status string `json:"status"` // written or unchanged
		data   []byte
	}
	var files []file
	for _, name := range names {
		data, err := fs.ReadFile(migrations.FS, name)
		if err != nil {
			return err
		}
		f := file{Name: filepath.Join(dir, name), Status: "written", data: data}
		switch old, err := os.ReadFile(f.Name); {
		case err == nil && bytes.Equal(old, data):
			f.Status = "unchanged"
		case err == nil:
			return fmt.Errorf("%s exists with other content; nothing written (migrations are never edited: export into an empty directory, or the one an earlier export wrote)", safe(strconv.Quote(f.Name)))
		case !errors.Is(err, fs.ErrNotExist):
			return err
		}
		files = append(files, f)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range files {
		if f.Status == "written" {
			if err := os.WriteFile(f.Name, f.data, 0o644); err != nil {
				return err
			}
		}
	}
	if e.json {
		return e.printJSON(files)
	}
	for _, f := range files {
		fmt.Fprintf(e.stdout, "%-9s %s\n", f.Status, safe(f.Name))
	}
	fmt.Fprintf(e.stdout, "\napply them with:\n  goose -dir %s -table %s postgres \"$DATABASE_URL\" up\n",
		safe(strconv.Quote(dir)), migrations.TableName)
	return nil
}
