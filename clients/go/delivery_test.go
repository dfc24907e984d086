package messaging_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/memory"
)

// settleOnce runs one delivery of a fresh subscription on the memory backend through handler h
// and returns the subscription's account once the bus closed.
func settleOnce(t *testing.T, spec messaging.SubscriptionSpec, h messaging.Handler) (messaging.ConsumerStats, messaging.RuntimeStats) {
	t.Helper()
	b := memory.New()
	bus := messaging.New(b, messaging.Options{NoReports: true})
	done := make(chan struct{})
	var once sync.Once
	spec.Name, spec.Pattern = "orders", "orders.>"
	spec.Handler = func(ctx context.Context, d messaging.Delivery) error {
		defer once.Do(func() { close(done) })
		return h(ctx, d)
	}
	if err := bus.Subscribe(context.Background(), spec); err != nil {
		t.Fatal(err)
	}
	if err := bus.Publish(context.Background(), "orders.1", []byte(`{"id":1}`)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never ran")
	}
	time.Sleep(50 * time.Millisecond)
	bus.Close()
	st, _ := bus.Stats("orders")
	rt, _ := bus.RuntimeStats("orders")
	return st, rt
}

// S2: exactly one settlement per delivery, also from copies on other goroutines (AtMostOnce,
// so that a winning Nack brings nothing back: M1).
func TestOneSettlementWinsAcrossCopies(t *testing.T) {
	var refused atomic.Int32
	st, _ := settleOnce(t, messaging.SubscriptionSpec{},
		func(_ context.Context, d messaging.Delivery) error {
			var wg sync.WaitGroup
			for i := range 16 {
				wg.Add(1)
				go func(copy messaging.Delivery) {
					defer wg.Done()
					var err error
					if i%2 == 0 {
						err = copy.Ack()
					} else {
						err = copy.Nack()
					}
					if errors.Is(err, messaging.ErrAlreadySettled) {
						refused.Add(1)
					}
				}(d)
			}
			wg.Wait()
			return nil
		})
	if refused.Load() != 15 {
		t.Fatalf("%d of 16 settlements refused, want 15", refused.Load())
	}
	if got := st.Settlement.Acked + st.Settlement.Nacked; got != 1 || st.Settlement.Silent != 0 {
		t.Fatalf("one settlement counted, and no silence: %+v", st)
	}
}

// B3: NackAfter above the ceiling, negative, or with no ceiling records nothing, and the
// handler can still settle.
func TestANackAfterRefusedRecordsNothing(t *testing.T) {
	cases := []struct {
		name  string
		spec  messaging.SubscriptionSpec
		delay time.Duration
		says  string
	}{
		{"no ceiling", messaging.SubscriptionSpec{Mode: messaging.AtLeastOnce, DurableName: "orders"}, time.Second, "neither MaxNackDelay nor Backoff"},
		{"above the ceiling", messaging.SubscriptionSpec{Mode: messaging.AtLeastOnce, DurableName: "orders", MaxNackDelay: time.Second}, 2 * time.Second, "above this subscription's ceiling of 1s"},
		{"negative", messaging.SubscriptionSpec{Mode: messaging.AtLeastOnce, DurableName: "orders", MaxNackDelay: time.Second}, -time.Second, "negative delay"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var first error
			st, _ := settleOnce(t, c.spec, func(_ context.Context, d messaging.Delivery) error {
				first = d.NackAfter(c.delay)
				return d.Ack()
			})
			var de *messaging.DelayError
			if !errors.As(first, &de) || !strings.Contains(first.Error(), c.says) {
				t.Fatalf("NackAfter(%s): %v, want a DelayError saying %q", c.delay, first, c.says)
			}
			if st.Settlement.Acked != 1 || st.Settlement.Nacked != 0 {
				t.Fatalf("the refused NackAfter recorded something, or the ack after it was lost: %+v", st)
			}
		})
	}
}

// S3: the returned error never settles; M1: under AtMostOnce a decline is recorded, never acted on.
func TestAnErrorWithoutSettlementIsSilentAndCounted(t *testing.T) {
	st, rt := settleOnce(t, messaging.SubscriptionSpec{}, func(context.Context, messaging.Delivery) error {
		return errors.New("downstream is down")
	})
	if st.Settlement.Silent != 1 || st.Delivered != 1 || st.Offered != 1 || rt.HandlerErrors != 1 {
		t.Fatalf("silent 1, delivered 1, handlerErrors 1: %+v %+v", st, rt)
	}
}

// A subscription the backend cannot honour is refused with every finding, the field named.
func TestASpecTheBackendCannotHonourIsRefused(t *testing.T) {
	bus := messaging.New(memory.New(), messaging.Options{NoReports: true})
	err := bus.Subscribe(context.Background(), messaging.SubscriptionSpec{
		Name: "orders", Pattern: "orders.>", Mode: messaging.AtLeastOnce,
		Handler: func(context.Context, messaging.Delivery) error { return nil },
	})
	var r *messaging.RefusedError
	if !errors.As(err, &r) || !strings.Contains(err.Error(), `subscription "orders" cannot run on the memory backend: spec.durableName: required under mode AtLeastOnce`) {
		t.Fatalf("%v", err)
	}
}

// A handler still running when the close grace ends has its attempt released (C3); what it
// settles afterwards returns ErrReleased and counts nothing (the Rust runtime aborts it).
func TestASettlementAfterTheReleaseCountsNothing(t *testing.T) {
	b := memory.New()
	bus := messaging.New(b, messaging.Options{NoReports: true, CloseGrace: 100 * time.Millisecond})
	started, answered := make(chan struct{}), make(chan error, 1)
	err := bus.Subscribe(context.Background(), messaging.SubscriptionSpec{
		Name: "orders", Pattern: "orders.>", Mode: messaging.AtLeastOnce, DurableName: "orders",
		Handler: func(ctx context.Context, d messaging.Delivery) error {
			close(started)
			<-ctx.Done() // the close gives up on it
			answered <- d.Ack()
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.Publish(context.Background(), "orders.1", []byte(`{"id":1}`)); err != nil {
		t.Fatal(err)
	}
	<-started
	bus.Close()
	if err := <-answered; !errors.Is(err, messaging.ErrReleased) {
		t.Fatalf("an ack after the release: %v, want ErrReleased", err)
	}
	st, _ := bus.Stats("orders")
	if st.Released != 1 || st.Settlement.Acked != 0 || st.Delivered != 0 || st.Offered != 1 {
		t.Fatalf("released, nothing else: %+v", st)
	}
	if b.Pending("orders") != 1 {
		t.Fatalf("the broker owes it back: %d pending", b.Pending("orders"))
	}
}
