package messaging

// The runtime's own cost a message, with no broker: a consumer that makes each delivery at
// once (as a backend does, with a settler of its own) and a handler that acks. What `go run
// ./cmd/bench` adds on top of a bare client is this, plus the backend's settlement.

import (
	"context"
	"testing"
	"time"
)

type benchSettler struct{ reply string }

func (*benchSettler) Settle(context.Context, BrokerAction) (Performed, *Refusal) {
	return AsAsked, nil
}
func (*benchSettler) Progress(context.Context) *Refusal { return nil }
func (*benchSettler) Release(context.Context)           {}

type benchConsumer struct {
	sub     *Sub
	end     context.CancelFunc
	left    int
	payload []byte
}

func (c *benchConsumer) Next(context.Context) (Delivery, bool) {
	if c.left == 0 {
		c.end() // the subscription ends with its consumer, as a close ends it
		return Delivery{}, false
	}
	c.left--
	return NewDelivery(c.sub, DeliveryOptions{Subject: "orders.m", Payload: c.payload, Attempt: 1,
		OnSettle: &benchSettler{reply: "$JS.ACK.s.c.1.2.3.4.5"}}), true
}
func (*benchConsumer) Stop(context.Context)   {}
func (*benchConsumer) Retire(context.Context) {}

func BenchmarkDispatchAck(b *testing.B) {
	spec := SubscriptionSpec{Name: "bench", Pattern: "orders.>", Mode: AtLeastOnce, MaxDeliver: 5}
	p := spec.Resolve()
	sub := NewSub(p, "ns", 1)
	ctx, end := context.WithCancel(context.Background())
	c := &benchConsumer{sub: sub, end: end, left: b.N, payload: []byte(`{"order":12345,"item":"a thing of ninety bytes or so, as the bench sends it"}`)}
	lease := &leaseTimes{ackWait: p.AckWait, maxProcessing: p.MaxProcessingTime}
	b.ReportAllocs()
	b.ResetTimer()
	dispatch(ctx, sub, func(_ context.Context, d Delivery) error { return d.Ack() }, c, time.Second, lease)
	b.StopTimer()
	if st, _ := sub.Stats(); st.Settlement.Acked != uint64(b.N) {
		b.Fatalf("acked %d of %d", st.Settlement.Acked, b.N)
	}
}
