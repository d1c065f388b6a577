package main

import (
	"encoding/json"
	"fmt"
	"sort"

	"github.com/atomicphase/atomicphase/examples/rocketrides/rides"
)

// answer is the last response a client got for its key.
type answer struct {
	Status int
	Body   []byte
}

type rideRow struct {
	ID       int64
	User     string
	Status   string
	ChargeID string
}

type chargeRow struct {
	ID     string
	User   string
	Status string
}

// receiptRow is a row the receipts service wrote.
type receiptRow struct {
	RideID   int64
	ChargeID string
}

// facts is everything the demo observed, from the clients, the service's
// database, the provider's table, the JetStream stream and the receipts
// service's table.
type facts struct {
	Requested           int
	Answers             map[string]answer // idempotency key -> final answer
	Rides               []rideRow
	Charges             []chargeRow
	Receipts            []rides.Receipt
	ReceiptRows         []receiptRow // written by the receipts service, through its inbox
	DeadLetters         int          // receipts the receipts service gave up on
	InconsistentReplays int          // replays whose body differed from the first answer
}

// check returns every broken exactly-once invariant, or none.
func check(f facts) []string {
	var bad []string
	fail := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }

	created, declined := 0, 0
	answeredCharges := map[string]int{}
	for key, a := range f.Answers {
		switch a.Status {
		case 201:
			created++
			var c rides.Created
			if err := json.Unmarshal(a.Body, &c); err != nil || c.ChargeID == "" {
				fail("key %s: 201 without a charge id: %s", key, a.Body)
				continue
			}
			answeredCharges[c.ChargeID]++
		case 402:
			declined++
		default:
			fail("key %s: final answer %d, want 201 or 402", key, a.Status)
		}
	}
	if len(f.Answers) != f.Requested {
		fail("%d rides requested, %d answered", f.Requested, len(f.Answers))
	}
	if len(f.Rides) != f.Requested {
		fail("%d rides requested, %d rides in the database", f.Requested, len(f.Rides))
	}
	for id, n := range answeredCharges {
		if n > 1 {
			fail("charge %s was answered to %d different rides", id, n)
		}
	}

	charged := map[int64]rideRow{}
	rideCharges := map[string]int{}
	nDeclined := 0
	for _, r := range f.Rides {
		switch r.Status {
		case "charged":
			charged[r.ID] = r
			rideCharges[r.ChargeID]++
		case "declined":
			nDeclined++
		default:
			fail("ride %d is %q, not finished", r.ID, r.Status)
		}
	}
	if len(charged) != created {
		fail("%d rides charged in the database, %d answered 201", len(charged), created)
	}
	if nDeclined != declined {
		fail("%d rides declined in the database, %d answered 402", nDeclined, declined)
	}

	succeeded := 0
	for _, c := range f.Charges {
		if c.Status != "succeeded" {
			continue
		}
		succeeded++
		if rideCharges[c.ID] != 1 {
			fail("provider charge %s (user %s) belongs to %d rides, want 1", c.ID, c.User, rideCharges[c.ID])
		}
	}
	if succeeded != len(charged) {
		fail("%d successful charges at the provider, %d charged rides", succeeded, len(charged))
	}
	for id, n := range rideCharges {
		if n > 1 {
			fail("charge %s recorded on %d rides", id, n)
		}
	}

	seen := map[int64]int{}
	for _, rc := range f.Receipts {
		seen[rc.RideID]++
		r, ok := charged[rc.RideID]
		switch {
		case !ok:
			fail("receipt for ride %d, which is not charged", rc.RideID)
		case r.ChargeID != rc.ChargeID:
			fail("receipt for ride %d names charge %s, the ride has %s", rc.RideID, rc.ChargeID, r.ChargeID)
		}
	}
	var dups []int64
	for id, n := range seen {
		if n > 1 {
			dups = append(dups, id)
		}
	}
	sort.Slice(dups, func(i, j int) bool { return dups[i] < dups[j] })
	for _, id := range dups {
		fail("ride %d has %d receipts in JetStream", id, seen[id])
	}
	if len(seen) != len(charged) {
		fail("%d rides have receipts, %d rides are charged", len(seen), len(charged))
	}
	rows := map[int64]int{}
	for _, rr := range f.ReceiptRows {
		rows[rr.RideID]++
		r, ok := charged[rr.RideID]
		switch {
		case !ok:
			fail("receipt row for ride %d, which is not charged", rr.RideID)
		case r.ChargeID != rr.ChargeID:
			fail("receipt row for ride %d names charge %s, the ride has %s", rr.RideID, rr.ChargeID, r.ChargeID)
		}
	}
	dups = dups[:0]
	for id, n := range rows {
		if n > 1 {
			dups = append(dups, id)
		}
	}
	sort.Slice(dups, func(i, j int) bool { return dups[i] < dups[j] })
	for _, id := range dups {
		fail("ride %d has %d receipt rows: a redelivered receipt was handled twice", id, rows[id])
	}
	for id := range charged {
		if rows[id] == 0 {
			fail("charged ride %d has no receipt row", id)
		}
	}
	if f.DeadLetters > 0 {
		fail("the receipts service dead-lettered %d receipts", f.DeadLetters)
	}
	if f.InconsistentReplays > 0 {
		fail("%d replays differed from the first answer", f.InconsistentReplays)
	}
	return bad
}
