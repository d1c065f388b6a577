package rides

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/atomicphase/atomicphase/inbox/natsin"
)

// ReceiptsConsumer names the receipts service: its JetStream durable
// consumer and its inbox consumer.
const ReceiptsConsumer = "receipts"

// ReceiptsSchema creates the receipts service's table: one row per
// receipt it handled. ride_id is deliberately not unique: the inbox, not a
// constraint, keeps a redelivered receipt from being written twice, and
// the demo checks that it does.
const ReceiptsSchema = `
CREATE TABLE IF NOT EXISTS receipts (
	id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	ride_id      bigint NOT NULL,
	user_id      text NOT NULL,
	charge_id    text NOT NULL,
	amount_cents bigint NOT NULL,
	message_id   text NOT NULL,
	received_at  timestamptz NOT NULL DEFAULT now()
)`

// ReceiptsMaxDeliver is how many times JetStream delivers a receipt before
// the receipts service dead-letters it.
const ReceiptsMaxDeliver = 10

// EnsureReceiptsConsumer creates (or updates) the receipts service's
// durable pull consumer on the receipts stream: explicit acks after each
// commit, redelivery after ackWait, at most ReceiptsMaxDeliver deliveries.
func EnsureReceiptsConsumer(ctx context.Context, js jetstream.JetStream, stream, prefix string, ackWait time.Duration) (jetstream.Consumer, error) {
	return js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:       ReceiptsConsumer,
		FilterSubject: prefix + ReceiptTopic,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    ReceiptsMaxDeliver,
	})
}

// HandleReceipt is the receipts service's handler: it writes the receipt's
// row in the inbox's transaction. A payload that does not decode is an
// error on every delivery, and ends as a dead letter.
func HandleReceipt(ctx context.Context, tx pgx.Tx, msg natsin.Message) error {
	var rc Receipt
	if err := json.Unmarshal(msg.Data, &rc); err != nil || rc.RideID == 0 || rc.ChargeID == "" {
		return fmt.Errorf("rides: receipt %s: not a receipt: %q", msg.ID, msg.Data)
	}
	_, err := tx.Exec(ctx, `INSERT INTO receipts (ride_id, user_id, charge_id, amount_cents, message_id)
		VALUES ($1, $2, $3, $4, $5)`, rc.RideID, rc.User, rc.ChargeID, rc.AmountCents, msg.ID)
	return err
}
