package txn

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/internal/pgtest"
)

// checkNumeric must accept exactly the JSON numbers PostgreSQL's numeric,
// and so jsonb, accepts: asked of PostgreSQL itself, for the limits' edges
// and for random literals around them.
func TestNumericLimitsMatchPostgreSQL(t *testing.T) {
	t.Parallel()
	d := pgtest.New(t)
	ctx := context.Background()
	_, err := d.Pool.Exec(ctx, `
		CREATE FUNCTION accepts(lit text, as_jsonb boolean) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
			IF as_jsonb THEN PERFORM lit::jsonb; ELSE PERFORM lit::numeric; END IF;
			RETURN true;
		EXCEPTION WHEN data_exception THEN
			RETURN false;
		END $$`)
	require.NoError(t, err)

	zeros := strings.Repeat
	lits := []string{
		"0", "-0", "1", "-1", "0.0", "1.5", "123456789012345678901234567890.123456789",
		"1e131071", "1e131072", "9.99e131071", "9999e131068", "99999e131067",
		"0.0001e131076", "0.0001e131075", "1e-16383", "1e-16384", "1.5e-16382", "1.5e-16383",
		"0e-16383", "0e-16384", "0e1000000", "0e1073741822", "0e1073741823", "1e-1073741823",
		"0." + zeros("0", 16383), "0." + zeros("0", 16384), "1" + zeros("0", 131071), "1" + zeros("0", 131072),
		"1E+2", "1e+131071", "1e1000000", "-1e1000000", "1e-1000000", "12.5E-3",
		"0.000001e-16377", "0.000001e-16378", "10e131070", "10e131071", "0.1e131072", "0.1e131073",
		"1e-131072", "1e-131073", "1e-131075", "1e-131076",
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 400 {
		intDigits := r.IntN(6)
		lit := ""
		if r.IntN(2) == 0 {
			lit = "-"
		}
		if intDigits == 0 {
			lit += "0"
		} else {
			lit += fmt.Sprint(1 + r.IntN(9))
			for range intDigits - 1 {
				lit += fmt.Sprint(r.IntN(10))
			}
		}
		if r.IntN(2) == 0 {
			lit += "." + fmt.Sprint(r.IntN(1000))
		}
		edge := []int{131068, 131072, 16380, 16384, 1000000, 1 << 29}[r.IntN(6)]
		exp := edge - 8 + r.IntN(16)
		if r.IntN(2) == 0 {
			exp = -exp
		}
		lits = append(lits, fmt.Sprintf("%se%d", lit, exp))
	}

	for _, asJSONB := range []bool{false, true} {
		var got []bool
		require.NoError(t, d.Pool.QueryRow(ctx, `SELECT array_agg(accepts(l, $2) ORDER BY o) FROM unnest($1::text[]) WITH ORDINALITY AS u(l, o)`,
			lits, asJSONB).Scan(&got))
		accepted := 0
		for i, lit := range lits {
			err := checkNumeric(lit)
			require.Equal(t, got[i], err == nil, "PostgreSQL (jsonb %v) and checkNumeric disagree on %.60s: %v", asJSONB, lit, err)
			if got[i] {
				accepted++
			}
		}
		require.Greater(t, accepted, 100, "the table probes both sides of the limits")
		require.Less(t, accepted, len(lits)-100)
	}
}
