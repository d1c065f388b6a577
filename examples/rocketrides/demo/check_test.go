package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
)

func consistentFacts() facts {
	body := func(id int64, ch string) []byte {
		b, _ := json.Marshal(rides.Created{ID: id, ChargeID: ch, AmountCents: 900})
		return b
	}
	return facts{
		Requested: 3,
		Answers: map[string]answer{
			"k1": {201, body(1, "ch_a")}, "k2": {201, body(2, "ch_b")}, "k3": {402, []byte(`{"error":"card_declined"}`)},
		},
		Rides:       []rideRow{{1, "u1", "charged", "ch_a"}, {2, "u2", "charged", "ch_b"}, {3, "declined-u3", "declined", ""}},
		Charges:     []chargeRow{{"ch_a", "u1", "succeeded"}, {"ch_b", "u2", "succeeded"}, {"ch_c", "declined-u3", "declined"}},
		Receipts:    []rides.Receipt{{RideID: 1, User: "u1", ChargeID: "ch_a"}, {RideID: 2, User: "u2", ChargeID: "ch_b"}},
		ReceiptRows: []receiptRow{{1, "ch_a"}, {2, "ch_b"}},
	}
}

func TestCheckPassesConsistentFacts(t *testing.T) {
	t.Parallel()
	require.Empty(t, check(consistentFacts()))
}

func TestCheckFailsOnInjectedDuplicates(t *testing.T) {
	t.Parallel()
	for name, inject := range map[string]func(*facts){
		"duplicate receipt": func(f *facts) { f.Receipts = append(f.Receipts, f.Receipts[0]) },
		"duplicate charge":  func(f *facts) { f.Charges = append(f.Charges, chargeRow{"ch_z", "u1", "succeeded"}) },
		"duplicate ride":    func(f *facts) { f.Rides = append(f.Rides, rideRow{4, "u1", "charged", "ch_a"}) },
		"lost receipt":      func(f *facts) { f.Receipts = f.Receipts[:1] },
		"duplicate row":     func(f *facts) { f.ReceiptRows = append(f.ReceiptRows, f.ReceiptRows[1]) },
		"lost row":          func(f *facts) { f.ReceiptRows = f.ReceiptRows[1:] },
		"row of a decline":  func(f *facts) { f.ReceiptRows = append(f.ReceiptRows, receiptRow{3, "ch_c"}) },
		"row, wrong charge": func(f *facts) { f.ReceiptRows[0].ChargeID = "ch_b" },
		"dead letter":       func(f *facts) { f.DeadLetters = 1 },
		"unanswered ride":   func(f *facts) { delete(f.Answers, "k2") },
		"replay mismatch":   func(f *facts) { f.InconsistentReplays = 1 },
		"unfinished ride":   func(f *facts) { f.Rides[1].Status = "created" },
	} {
		f := consistentFacts()
		inject(&f)
		require.NotEmpty(t, check(f), name)
	}
}
