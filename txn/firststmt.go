package txn

import (
	"context"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// In pgx's cache_statement mode (its default) a statement pgx has not
// prepared yet is prepared in a round trip of its own, before the rest of
// a batch: for a function's first statement that would be before BEGIN
// and the key's insert, taking the statement's table locks before the key
// (see statementsRide). So a Run's first statement is prepared by the Run
// itself, inside its transaction after the key is taken, under a text of
// its own (the statement and firstStatementMark), and recorded on the
// connection. The next Run on that connection whose first statement is the
// same finds it prepared, and sends it with BEGIN and the key's insert:
// 3 round trips, as in the exec mode.
//
// The text is the statement with a comment after it, so it means what the
// statement means, and pgx's own statement cache, which names statements
// after their text, never holds it. A string without whitespace is taken
// for the name of a statement the user prepared (pgx runs one by its name)
// and is never prepared this way; every statement's text has whitespace.

// firstStatementMark ends the text a function's first statement is
// prepared under.
const firstStatementMark = "\n-- atomicphase: first statement"

// maxFirstStatements bounds the first statements prepared on a connection.
// Past it, a first statement goes out as on any pgx.Tx.
const maxFirstStatements = 64

// firstStatementsKey holds a connection's firstStatements in its
// pgconn.PgConn's CustomData, which lives and dies with the connection.
const firstStatementsKey = "atomicphase.txn.first_statements"

// firstStatements are the first statements prepared on a connection, by
// their SQL.
type firstStatements struct {
	bySQL map[string]*firstStatement
	// refused counts the entries of bySQL the server refused to prepare
	// (see prepareFirst): they do not count toward maxFirstStatements, and
	// at most maxFirstStatements of them are kept.
	refused int
	// eqb encodes a prepared first statement's arguments before it travels:
	// in this mode pgx encodes a batch's statements only after BEGIN is on
	// its way, and an argument it cannot encode then ends the connection.
	eqb pgx.ExtendedQueryBuilder
}

// firstStatement is one first statement prepared on a connection.
type firstStatement struct {
	text string                       // what it was prepared under, and runs by
	sd   *pgconn.StatementDescription // its parameters, for the encoding check
	// failed is set once a transaction failed after it ran: the server may
	// have changed or dropped it under pgx's description, so from then on
	// it goes out as on any pgx.Tx.
	failed bool
}

func firstStatementsOf(conn *pgx.Conn) *firstStatements {
	data := conn.PgConn().CustomData()
	if fs, ok := data[firstStatementsKey].(*firstStatements); ok {
		return fs
	}
	fs := &firstStatements{bySQL: map[string]*firstStatement{}}
	data[firstStatementsKey] = fs
	return fs
}

// travelling returns the text sql was prepared under on conn, if it was,
// has not failed since, and pgx can encode args for it (else pgx would
// find out with BEGIN on its way).
func (fs *firstStatements) travelling(conn *pgx.Conn, sql string, args []any) (string, bool) {
	st, ok := fs.bySQL[sql]
	if !ok || st.failed {
		return "", false
	}
	if !stillPrepared(conn, st) {
		// Dropped outside a Run (pgx's DeallocateAll): prepare it again
		// after the key (preparable).
		delete(fs.bySQL, sql)
		return "", false
	}
	if fs.eqb.Build(conn.TypeMap(), st.sd, args) != nil {
		return "", false
	}
	return st.text, true
}

// stillPrepared reports whether pgx still knows st as prepared on conn: an
// application may drop a connection's statements (pgx's DeallocateAll,
// e.g. in a pool's AfterRelease), and pgx would then prepare st's text
// again before BEGIN. pgx answers Prepare from its own record without a
// round trip for a statement it knows; on a context already done it sends
// nothing for one it does not, and fails. A tracer sees that Prepare (with
// AlreadyPrepared set when it is).
func stillPrepared(conn *pgx.Conn, st *firstStatement) bool {
	sd, err := conn.Prepare(doneContext, st.text, st.text)
	return err == nil && sd == st.sd
}

// doneContext is a context already done (see stillPrepared).
var doneContext = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// preparable reports whether sql may be prepared as a first statement: it
// was not before on this connection, there is room, and it is a
// statement's text, not the name of a prepared statement.
func (fs *firstStatements) preparable(sql string) bool {
	_, seen := fs.bySQL[sql]
	return !seen && len(fs.bySQL)-fs.refused < maxFirstStatements && strings.ContainsAny(sql, " \t\r\n")
}

// prepareFirst prepares the user's first statement sql inside the
// transaction, which has taken the key, and returns the text to run it by.
func (l *lazyTx) prepareFirst(ctx context.Context, sql string) (string, error) {
	text := sql + firstStatementMark
	sd, err := l.conn.Prepare(ctx, text, text)
	if err != nil {
		// Not a statement the server takes: the name of a prepared
		// statement that has whitespace in it, or SQL it refuses. The
		// failed prepare aborted the transaction before any of the
		// function's statements ran: the run goes again (errRunAgain),
		// and from then on sql goes out as on any pgx.Tx on this
		// connection, where pgx runs a name by its name and SQL the server
		// refuses fails as it would there.
		if fs := firstStatementsOf(l.conn); fs.refused < maxFirstStatements {
			fs.bySQL[sql] = &firstStatement{failed: true}
			fs.refused++
		}
		l.again = true
		return "", err
	}
	firstStatementsOf(l.conn).bySQL[sql] = &firstStatement{text: text, sd: sd}
	l.first = text
	return text, nil
}

// errRunAgain: the function's first statement could not be prepared after
// the key (see prepareFirst); the run is rolled back and goes again at once,
// whatever the function made of the statement's error; once per call: the
// call's later runs prepare nothing themselves (see lazyTx.prep), so a
// function whose first statement differs on every run does not loop.
var errRunAgain = errors.New("the first statement was not preparable: run again")

// forgetFirst marks the first statement the transaction ran by its
// prepared text as failed, when the transaction failed after it ran.
func (l *lazyTx) forgetFirst() {
	if st, ok := firstStatementsOf(l.conn).bySQL[strings.TrimSuffix(l.first, firstStatementMark)]; ok {
		st.failed = true
	}
}
