package nats_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
	settlenats "settle.dev/messaging/nats"
)

func natsURL(t *testing.T) string {
	if testing.Short() {
		t.Skip("needs the environment's nats-server: `make test` runs it")
	}
	v := os.Getenv("SETTLE_NATS_URL")
	if v == "" {
		t.Fatal("SETTLE_NATS_URL is not set: start the environment (`make env-up`, then `source target/env/settle.env`); `make test` does both")
	}
	return v
}

// A stream of the test's own, the bucket of its own, and a consumer made as the operator
// makes one for Subscription <ns>/orders of object uid.
func operatorConsumer(t *testing.T, b *settlenats.Broker, prefix, uid string) jetstream.ConsumerConfig {
	ctx := context.Background()
	stream := strings.ReplaceAll(prefix, ".", "_")
	if _, err := b.JetStream().CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.JetStream().DeleteStream(context.Background(), stream) })
	p := messaging.SubscriptionSpec{Name: "orders", Pattern: prefix + ".>", Mode: messaging.AtLeastOnce, DurableName: "orders", MaxDeliver: 5}.Resolve()
	c := settlenats.Desired("shop", "orders", p)
	c.Metadata[settlenats.UIDKey] = uid
	if _, err := b.JetStream().CreateConsumer(ctx, stream, c); err != nil {
		t.Fatal(err)
	}
	return c
}

func report(t *testing.T, kv jetstream.KeyValue, key string) messaging.StatsReport {
	e, err := kv.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("report %s: %v", key, err)
	}
	var r messaging.StatsReport
	if err := json.Unmarshal(e.Value(), &r); err != nil {
		t.Fatal(err)
	}
	return r
}

func waitFor(t *testing.T, what string, f func() bool) {
	deadline := time.Now().Add(30 * time.Second)
	for !f() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Bound to the operator's consumer, the runtime reports under its key with the object's UID
// (docs/stats-report.md); when the mark names another object (a takeover), it starts a new
// count for it within a mark re-read, and the last report at Close carries every count.
func TestTheReportNamesTheOperatorsObjectAndFollowsATakeover(t *testing.T) {
	url := natsURL(t)
	prefix := fmt.Sprintf("gorep.%d.%d", os.Getpid(), time.Now().UnixNano()%1e9)
	b, err := settlenats.Connect(url, "shop")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	bucket := strings.ReplaceAll(prefix, ".", "-")
	b.WithStatsBucket(bucket)
	t.Cleanup(func() { _ = b.JetStream().DeleteKeyValue(context.Background(), bucket) })
	cfg := operatorConsumer(t, b, prefix, "uid-1")
	ctx := context.Background()

	bus := messaging.New(b, messaging.Options{Namespace: "shop", Instance: "app-1", ReportInterval: 100 * time.Millisecond})
	err = bus.Subscribe(ctx, messaging.SubscriptionSpec{
		Name: "orders", Pattern: prefix + ".>", Mode: messaging.AtLeastOnce, DurableName: "orders", MaxDeliver: 5,
		OwnedByOperator: true,
		Handler:         func(_ context.Context, d messaging.Delivery) error { return d.Ack() },
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := bus.Publish(ctx, prefix+".m", []byte(fmt.Sprintf(`{"id":%d}`, i))); err != nil {
			t.Fatal(err)
		}
	}
	kv, err := b.JetStream().KeyValue(ctx, bucket)
	waitFor(t, "the report bucket", func() bool { kv, err = b.JetStream().KeyValue(ctx, bucket); return err == nil })
	key := "shop.orders.app-1"
	waitFor(t, "three acked in the report", func() bool {
		e, err := kv.Get(ctx, key)
		return err == nil && strings.Contains(string(e.Value()), `"acked":3`)
	})
	first := report(t, kv, key)
	if first.SubscriptionUID != "uid-1" || first.Backend != "nats" || first.Mode != "AtLeastOnce" || first.DurableName != "orders" || first.Version != 1 {
		t.Fatalf("report %+v", first)
	}

	// A takeover: the mark names another object.
	cfg.Metadata[settlenats.UIDKey] = "uid-2"
	stream := strings.ReplaceAll(prefix, ".", "_")
	if _, err := b.JetStream().UpdateConsumer(ctx, stream, cfg); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "a report for the new object", func() bool { return report(t, kv, key).SubscriptionUID == "uid-2" })
	if err := bus.Publish(ctx, prefix+".m", []byte(`{"id":9}`)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the new object's one delivery", func() bool { return report(t, kv, key).Stats.Delivered == 1 })
	bus.Close()
	last := report(t, kv, key)
	if last.StartedAtMs <= first.StartedAtMs || last.Stats.Offered != 1 || last.Stats.Settlement.Acked != 1 || last.Sequence <= first.Sequence {
		t.Fatalf("the new object's count starts afresh and goes on: first %+v, last %+v", first, last)
	}
	if st, _ := bus.Stats("orders"); st.Offered != 4 {
		t.Fatalf("the process's own account keeps every count: %+v", st)
	}
}
