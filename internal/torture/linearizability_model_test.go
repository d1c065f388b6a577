package torture

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/require"
)

// This file is the sequential specification TestLinearizability checks
// histories against: a keyed operation that executes at most once and
// memoizes its answer. See TestLinearizability for the prose version.

// callKind is what a recorded call did with its key.
type callKind string

const (
	callRun      callKind = "run"      // Runner.Run (a single-phase key)
	callWorkflow callKind = "workflow" // Runner.RunWorkflow (Atomic, Foreign, Finish)
	callResume   callKind = "resume"   // Runner.Resume: the stored request, whoever sent it
	// callClaim is the first commit of a workflow call that may have
	// executed (answered fresh, or indeterminate): its key row, which
	// other callers see (in use, reused) before the answer is stored. The
	// recorder adds it beside the call, over the same interval; it is
	// indeterminate when the call is.
	callClaim callKind = "claim"
	callAudit callKind = "audit" // the end state read in SQL once every caller stopped
)

// keyedCall is the input of one operation in a history.
type keyedCall struct {
	Key  string
	Kind callKind
	// Variant names the request's params: "A" is the key's usual request,
	// "B" the same key sent with other params (a different fingerprint).
	// Empty for resume and audit, which act on whatever request the key
	// row holds.
	Variant string
}

// outcome classifies what a call returned.
type outcome string

const (
	outAnswered      outcome = "answered"      // a response (Answer, Replayed)
	outInUse         outcome = "in use"        // ErrKeyInUse: a definite rejection
	outReused        outcome = "reused"        // ErrKeyReused: a definite rejection
	outNotFound      outcome = "not found"     // ErrKeyNotFound (Resume): a definite rejection
	outIndeterminate outcome = "indeterminate" // any other error: it may or may not have taken effect
	outAudited       outcome = "audited"       // the stored answer and the effects in the database
	outClaimed       outcome = "claimed"       // callClaim of a call that answered fresh
)

// keyedResult is the output of one operation in a history.
type keyedResult struct {
	Outcome  outcome
	Answer   answer // outAnswered: what the caller got; outAudited: what is stored
	Replayed bool   // outAnswered: the response said it was read from storage
	// Effects, for outAudited, are the effects the database holds for the
	// key (business rows and provider charges), in answer.Effects' form.
	Effects string
	// Err is the error's text, for descriptions only.
	Err string
}

// answer is a response as the model compares it.
type answer struct {
	// Text is status, headers and body, compared byte for byte.
	Text string
	// Variant is the request the answer was produced for, as its body says.
	Variant string
	// Effects are the effects the answer reports (execution ids of the
	// business rows, the provider's charge id), sorted and comma-joined:
	// what the database must hold for the key if this answer is stored.
	Effects string
	// Abandoned: the answer is the library's problem response for an
	// operation it stopped (a failed key), produced for no request and
	// reporting no effects.
	Abandoned bool
}

// pendingForever is the return time of an indeterminate call: its effect,
// if any, may be linearized at any point after it was invoked, also after
// it returned (a COMMIT the server applies after the client gave up), the
// way Jepsen treats an "info" operation.
const pendingForever = math.MaxInt64

// answerOf builds the model's answer from a response's parts.
func answerOf(status int, header http.Header, body []byte) answer {
	var text bytes.Buffer
	fmt.Fprintf(&text, "%d\n", status)
	_ = header.Write(&text) // sorted by name; a bytes.Buffer never fails
	text.WriteString("\n")
	text.Write(body)
	var fields answerBody
	_ = json.Unmarshal(body, &fields) // a body of another shape reports no variant and no effects
	return answer{Text: text.String(), Variant: fields.Variant, Effects: fields.effects(),
		Abandoned: header.Get("Content-Type") == "application/problem+json"}
}

// answerBody is the body the test's functions answer with.
type answerBody struct {
	Variant   string `json:"variant"`
	Execution string `json:"execution,omitempty"` // Run: the execution that wrote the row
	Order     string `json:"order,omitempty"`     // workflow: the execution of the Atomic phase
	Charge    string `json:"charge,omitempty"`    // workflow: the provider's charge
	Finish    string `json:"finish,omitempty"`    // workflow: the execution of Finish
}

func (b answerBody) effects() string {
	var effects []string
	for kind, id := range map[string]string{"run": b.Execution, "order": b.Order, "charge": b.Charge, "finish": b.Finish} {
		if id != "" {
			effects = append(effects, kind+":"+id)
		}
	}
	return joinEffects(effects)
}

func joinEffects(effects []string) string {
	slices.Sort(effects)
	return strings.Join(effects, ",")
}

// keyState is the model's state of one key.
type keyState struct {
	// Owner is the variant whose request the key row holds; "" while no
	// row is committed.
	Owner string
	// Stored is the stored answer's Text; "" while none is stored, or
	// while the one stored has not been seen (StoredUnseen).
	Stored string
	// StoredUnseen: an indeterminate call may have stored an answer that
	// no caller has seen yet; the next one seen is it.
	StoredUnseen bool
}

func (s keyState) answered() bool { return s.Stored != "" || s.StoredUnseen }

// requester is the variant whose request call c carries in state s:
// its own, or for a resume the one the key row holds.
func (s keyState) requester(c keyedCall) string {
	if c.Kind == callResume {
		return s.Owner
	}
	return c.Variant
}

// stepKey returns the states key state s may move to when call c returns r,
// none if it cannot.
func stepKey(s keyState, c keyedCall, r keyedResult) []keyState {
	switch r.Outcome {
	case outAnswered:
		return answerStep(s, c, r)
	case outInUse:
		// Another attempt holds the key: it has not answered yet.
		if s.answered() {
			return nil
		}
		return []keyState{s}
	case outReused:
		// The key row holds another request.
		if c.Kind == callResume || s.Owner == "" || s.Owner == c.Variant {
			return nil
		}
		return []keyState{s}
	case outNotFound:
		if c.Kind != callResume || s.Owner != "" {
			return nil
		}
		return []keyState{s}
	case outIndeterminate:
		return indeterminateStep(s, c)
	case outAudited:
		return auditStep(s, r)
	case outClaimed:
		// The key row holds the caller's request: this call's first phase
		// inserted it, or an earlier attempt's did and this one resumed it.
		if s.Owner != "" && s.Owner != c.Variant {
			return nil
		}
		return []keyState{{Owner: c.Variant, Stored: s.Stored, StoredUnseen: s.StoredUnseen}}
	}
	return nil
}

// answerStep: an answer is for the caller's own request and is the key's
// only answer; a fresh one (not replayed) is the one execution that stored
// it, a replayed one repeats what is stored.
func answerStep(s keyState, c keyedCall, r keyedResult) []keyState {
	v := s.requester(c)
	switch {
	case v == "":
		return nil // a resume answered for a key no row holds
	case s.Owner != "" && s.Owner != v:
		return nil // another request's key: the answer leaks it
	case r.Answer.Variant != v && !r.Answer.Abandoned:
		return nil // an answer produced for another request
	case r.Replayed && s.Stored != r.Answer.Text && !s.StoredUnseen:
		return nil // replayed something that is not stored
	case !r.Replayed && s.answered():
		return nil // executed again after an answer was stored
	case !r.Replayed && c.Kind == callWorkflow && s.Owner != v:
		return nil // a workflow's answer comes after its key row (callClaim)
	}
	return []keyState{{Owner: v, Stored: r.Answer.Text}}
}

// indeterminateStep: the call did nothing, or took some effect. A Run
// commits its key row and its answer together. A workflow's key row is
// its claim's to commit (callClaim, a step of its own); the workflow, or a
// resume, may then store an answer.
func indeterminateStep(s keyState, c keyedCall) []keyState {
	next := []keyState{s}
	if s.answered() {
		return next
	}
	v := s.requester(c)
	switch {
	case c.Kind == callRun && s.Owner == "":
		next = append(next, keyState{Owner: v, StoredUnseen: true})
	case c.Kind == callClaim && s.Owner == "":
		next = append(next, keyState{Owner: v})
	case (c.Kind == callWorkflow || c.Kind == callResume) && v != "" && s.Owner == v:
		next = append(next, keyState{Owner: v, StoredUnseen: true})
	}
	return next
}

// auditStep: once every caller stopped, the database holds the key's one
// answer, and the effects of exactly the execution that answer reports.
func auditStep(s keyState, r keyedResult) []keyState {
	if s.Owner == "" || (r.Answer.Variant != s.Owner && !r.Answer.Abandoned) ||
		(s.Stored != r.Answer.Text && !s.StoredUnseen) || r.Effects != r.Answer.Effects {
		return nil
	}
	return []keyState{{Owner: s.Owner, Stored: r.Answer.Text}}
}

// keyedOperationModel is the specification for porcupine, partitioned by key.
func keyedOperationModel() porcupine.Model {
	m := porcupine.NondeterministicModel{
		Partition: partitionByKey,
		Init:      func() []any { return []any{keyState{}} },
		Step: func(state, input, output any) []any {
			var next []any
			for _, s := range stepKey(state.(keyState), input.(keyedCall), output.(keyedResult)) {
				next = append(next, s)
			}
			return next
		},
		Hash: func(state any) uint64 {
			s := state.(keyState)
			h := fnv.New64a()
			fmt.Fprintf(h, "%s\x00%s\x00%t", s.Owner, s.Stored, s.StoredUnseen)
			return h.Sum64()
		},
		DescribeOperation: func(input, output any) string {
			return describeCall(input.(keyedCall), output.(keyedResult))
		},
		DescribeState: func(state any) string {
			s := state.(keyState)
			switch {
			case s.Owner == "":
				return "no key"
			case s.StoredUnseen:
				return s.Owner + ": an answer nobody saw yet"
			case s.Stored == "":
				return s.Owner + ": running"
			}
			return s.Owner + ": " + shortAnswer(s.Stored)
		},
	}
	return m.ToModel()
}

// checkLinearizable checks history against the model, with its pending
// calls reduced (reducePending), within timeout.
func checkLinearizable(history []porcupine.Operation, timeout time.Duration) porcupine.CheckResult {
	return porcupine.CheckOperationsTimeout(keyedOperationModel(), reducePending(history), timeout)
}

// reducePending drops the pending calls (pendingForever) that cannot
// change the verdict and bounds the others, so that the checker does not
// try every subset of a key's many indeterminate calls. It relies on two
// properties of the model: an indeterminate call may always do nothing,
// and two of a key's with the same kind and variant can do the same
// things, once at most (a claimed or answered key stays so). Hence:
//   - of those, only the earliest called is kept: whatever a later one did
//     at some instant, the earliest could have done at that instant;
//   - once a key has an answer, an indeterminate call leaves it as it is:
//     calls made after the key's first answer returned are dropped, and
//     the others end just after it (a linearization placing one later is
//     as good as one placing it right after that answer).
//
// Narrowing intervals and dropping calls that may do nothing never makes
// an illegal history legal; by the two properties it makes no legal one
// illegal.
func reducePending(history []porcupine.Operation) []porcupine.Operation {
	firstAnswer := map[string]int64{}
	for _, op := range history {
		if r := op.Output.(keyedResult); r.Outcome == outAnswered || r.Outcome == outAudited {
			k := op.Input.(keyedCall).Key
			if t, ok := firstAnswer[k]; !ok || op.Return < t {
				firstAnswer[k] = op.Return
			}
		}
	}
	earliest := map[keyedCall]int{} // a kept pending call's index in reduced, by input
	var reduced []porcupine.Operation
	for _, op := range history {
		c := op.Input.(keyedCall)
		if op.Return != pendingForever {
			reduced = append(reduced, op)
			continue
		}
		answeredAt, answered := firstAnswer[c.Key]
		if answered && op.Call > answeredAt {
			continue
		}
		if answered {
			op.Return = answeredAt + 1
		}
		if i, ok := earliest[c]; ok {
			if op.Call < reduced[i].Call {
				reduced[i] = op
			}
			continue
		}
		earliest[c] = len(reduced)
		reduced = append(reduced, op)
	}
	return reduced
}

func partitionByKey(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range history {
		k := op.Input.(keyedCall).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	partitions := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		partitions = append(partitions, byKey[k])
	}
	return partitions
}

func describeCall(c keyedCall, r keyedResult) string {
	call := string(c.Kind) + " " + c.Variant
	switch r.Outcome {
	case outAnswered:
		how := "fresh"
		if r.Replayed {
			how = "replayed"
		}
		return fmt.Sprintf("%s -> %s %s", call, how, shortAnswer(r.Answer.Text))
	case outAudited:
		return fmt.Sprintf("%s -> stored %s, effects %s", call, shortAnswer(r.Answer.Text), r.Effects)
	case outClaimed:
		return call + " -> the key row holds this request"
	case outIndeterminate:
		return fmt.Sprintf("%s -> indeterminate (%s)", call, r.Err)
	}
	return fmt.Sprintf("%s -> %s", call, r.Outcome)
}

// shortAnswer is an answer's status, headers and body on one line, for
// descriptions.
func shortAnswer(text string) string {
	status, rest, _ := strings.Cut(text, "\n")
	header, body, ok := strings.Cut(rest, "\r\n\n")
	if !ok { // no headers
		header, body = "", strings.TrimPrefix(rest, "\n")
	}
	return fmt.Sprintf("%s [%s] %s", status, strings.ReplaceAll(header, "\r\n", "; "), body)
}

// TestLinearizabilityModelRejectsBrokenHistories feeds the checker
// hand-built histories of one key: the broken ones must be rejected, so
// that TestLinearizability's "Ok" means something, and the legal ones that
// faults produce must be accepted, so that it does not fail on them.
func TestLinearizabilityModelRejectsBrokenHistories(t *testing.T) {
	t.Parallel()
	a1, a2 := testAnswer("A", "a1"), testAnswer("A", "a2")
	b1 := testAnswer("B", "b1")
	abandoned := answerOf(500, http.Header{"Content-Type": {"application/problem+json"}},
		[]byte(`{"title":"Operation could not be completed","status":500}`))
	run := func(v string) keyedCall { return keyedCall{Key: "k", Kind: callRun, Variant: v} }
	workflow := func(v string) keyedCall { return keyedCall{Key: "k", Kind: callWorkflow, Variant: v} }
	resume := keyedCall{Key: "k", Kind: callResume}
	audit := keyedCall{Key: "k", Kind: callAudit}
	claim := func(v string) keyedCall { return keyedCall{Key: "k", Kind: callClaim, Variant: v} }
	claimed := keyedResult{Outcome: outClaimed}
	fresh := func(a answer) keyedResult { return keyedResult{Outcome: outAnswered, Answer: a} }
	replayed := func(a answer) keyedResult { return keyedResult{Outcome: outAnswered, Answer: a, Replayed: true} }
	audited := func(a answer, effects string) keyedResult {
		return keyedResult{Outcome: outAudited, Answer: a, Effects: effects}
	}
	inUse := keyedResult{Outcome: outInUse}
	reused := keyedResult{Outcome: outReused}
	notFound := keyedResult{Outcome: outNotFound}
	unsure := keyedResult{Outcome: outIndeterminate, Err: "connection lost"}
	const never = pendingForever

	for _, tc := range []struct {
		name    string
		history []porcupine.Operation
		legal   bool
	}{
		// Broken histories.
		{"two executions answered, one after the other", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("A"), fresh(a2))), false},
		{"two executions answered concurrently", history(
			op(0, 3, run("A"), fresh(a1)), op(1, 2, run("A"), fresh(a2))), false},
		{"a replay of an answer that is not the stored one", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("A"), replayed(a2))), false},
		{"a replay before the execution it repeats", history(
			op(0, 1, run("A"), replayed(a1)), op(2, 3, run("A"), fresh(a1))), false},
		{"in use after the key answered", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("A"), inUse)), false},
		{"reused although no request holds the key", history(
			op(0, 1, run("B"), reused)), false},
		{"another request's answer replayed to it", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("B"), replayed(a1))), false},
		{"an answer after the key was found reused", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("B"), reused), op(4, 5, run("B"), fresh(b1))), false},
		{"a resume that finds no key after one was created", history(
			op(0, 1, claim("A"), claimed), op(0, 1, workflow("A"), fresh(a1)), op(2, 3, resume, notFound)), false},
		{"in use after a workflow answered", history(
			op(0, 1, claim("A"), claimed), op(0, 1, workflow("A"), fresh(a1)), op(2, 3, workflow("A"), inUse)), false},
		{"a workflow claims a key another request holds", history(
			op(0, 1, run("B"), fresh(b1)), op(2, 3, claim("A"), claimed), op(2, 3, workflow("A"), fresh(a1))), false},
		{"a resume that answers for a key never created", history(
			op(0, 1, resume, fresh(a1))), false},
		{"an execution after an unseen answer was replayed", history(
			op(0, never, run("A"), unsure), op(2, 3, run("A"), replayed(a1)), op(4, 5, run("A"), fresh(a2))), false},
		{"an indeterminate workflow stored an answer without a key row", history(
			op(0, never, workflow("A"), unsure), op(2, 3, workflow("A"), replayed(a1))), false},
		{"the database holds a second effect", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, audit, audited(a1, a1.Effects+",run:x"))), false},
		{"the database holds no effect", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, audit, audited(a1, ""))), false},
		{"an abandoned operation's effects remain", history(
			op(0, never, run("A"), unsure), op(2, 3, run("A"), replayed(abandoned)),
			op(4, 5, audit, audited(abandoned, "run:x"))), false},
		{"an operation abandoned although a caller got its answer", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, run("A"), replayed(abandoned))), false},
		{"the stored answer is not the one callers got", history(
			op(0, 1, run("A"), fresh(a1)), op(2, 3, audit, audited(a2, a2.Effects))), false},

		// Legal histories.
		{"one execution, with concurrent rejections and replays", history(
			op(0, 10, run("A"), fresh(a1)), op(1, 2, run("A"), inUse), op(5, 15, run("A"), replayed(a1)),
			op(11, 12, run("A"), replayed(a1)), op(20, 21, audit, audited(a1, a1.Effects))), true},
		{"in use overlapping the end of the execution", history(
			op(0, 5, run("A"), fresh(a1)), op(4, 8, run("A"), inUse)), true},
		{"an indeterminate call stored an answer that replays show", history(
			op(0, never, run("A"), unsure), op(5, 6, run("A"), replayed(a1)), op(7, 8, audit, audited(a1, a1.Effects))), true},
		{"an indeterminate call that did nothing", history(
			op(0, never, run("A"), unsure), op(5, 6, run("A"), fresh(a1)), op(7, 8, audit, audited(a1, a1.Effects))), true},
		{"an indeterminate call's commit landing after it returned", history(
			// It returned at 1, but its COMMIT reached the server later:
			// the key was in use at 2 and answered at 4.
			op(0, never, run("A"), unsure), op(2, 3, run("A"), inUse), op(4, 5, run("A"), replayed(a1))), true},
		{"the other request got the key first", history(
			op(0, 1, run("B"), fresh(b1)), op(2, 3, run("A"), reused), op(4, 5, audit, audited(b1, b1.Effects))), true},
		{"a workflow's first phase committed, then a resume finished it", history(
			op(0, never, claim("A"), unsure), op(0, never, workflow("A"), unsure), op(2, 3, workflow("B"), reused),
			op(4, 5, resume, fresh(a1)), op(6, 7, audit, audited(a1, a1.Effects))), true},
		{"an indeterminate workflow's key row seen before its unseen answer", history(
			op(0, never, claim("A"), unsure), op(0, never, workflow("A"), unsure), op(2, 3, workflow("B"), reused),
			op(4, 5, workflow("A"), inUse), op(6, 7, workflow("A"), replayed(a1))), true},
		{"many indeterminate calls, one of which stored the answer", history(
			op(0, never, run("A"), unsure), op(1, never, run("A"), unsure), op(2, never, run("A"), unsure),
			op(3, 4, run("A"), inUse), op(5, never, run("B"), unsure), op(6, 7, run("A"), replayed(a1)),
			op(8, never, run("A"), unsure), op(9, 10, audit, audited(a1, a1.Effects))), true},
		{"an operation the library abandoned, with no effects", history(
			op(0, never, run("A"), unsure), op(2, 3, run("A"), replayed(abandoned)), op(4, 5, run("B"), reused),
			op(6, 7, audit, audited(abandoned, ""))), true},
		{"a resume before the key existed", history(
			op(0, 1, resume, notFound), op(2, 3, claim("A"), claimed), op(2, 3, workflow("A"), fresh(a1))), true},
		{"a workflow's key row seen before its answer", history(
			op(0, 10, claim("A"), claimed), op(0, 10, workflow("A"), fresh(a1)), op(2, 3, workflow("B"), reused),
			op(4, 5, workflow("A"), inUse), op(11, 12, workflow("A"), replayed(a1))), true},
	} {
		require.Equal(t, tc.legal, porcupine.CheckOperations(keyedOperationModel(), tc.history), tc.name)
		want := porcupine.Illegal
		if tc.legal {
			want = porcupine.Ok
		}
		require.Equal(t, want, checkLinearizable(tc.history, time.Minute), "%s, pending calls reduced", tc.name)
	}
}

func testAnswer(variant, execution string) answer {
	body, _ := json.Marshal(answerBody{Variant: variant, Execution: execution})
	header := http.Header{"Content-Type": {"application/json"}, "X-Execution": {execution}}
	return answerOf(201, header, body)
}

func op(call, ret int64, input keyedCall, output keyedResult) porcupine.Operation {
	return porcupine.Operation{Input: input, Call: call, Output: output, Return: ret}
}

func history(ops ...porcupine.Operation) []porcupine.Operation { return ops }
