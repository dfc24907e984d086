package main

// NATS: a memory stream of its own a round; the bare side is a nats.go pull consumer with the
// consumer config the runtime makes and the pull it makes (nats/consume.go: the batch, bytes,
// expiry and heartbeat), acking each message.

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
	settlenats "settle.dev/messaging/nats"
)

var payload = []byte(`{"id":1,"item":"a benchmark order of about a hundred bytes, as orders go ......"}`)

func natsPlace(ctx context.Context, url string, round, messages int) (place, error) {
	nc, err := nats.Connect(url)
	if err != nil {
		return place{}, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return place{}, err
	}
	prefix := fmt.Sprintf("gobench.%d.%d", os.Getpid(), round)
	stream := strings.ReplaceAll(prefix, ".", "_")
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		nc.Close()
		return place{}, err
	}
	rt, err := settlenats.Connect(url, "bench")
	if err != nil {
		nc.Close()
		return place{}, err
	}
	p := place{
		runtime: rt,
		spec:    messaging.SubscriptionSpec{Name: "bench", Pattern: prefix + ".>", DurableName: "runtime", MaxDeliver: 5},
		cleanup: func() {
			_ = js.DeleteStream(context.Background(), stream)
			rt.Close()
			nc.Close()
		},
	}
	p.bare = func() error {
		spec := messaging.SubscriptionSpec{Name: "bench", Pattern: prefix + ".>", Mode: messaging.AtLeastOnce, DurableName: "bare", MaxDeliver: 5}
		cons, err := js.CreateConsumer(ctx, stream, settlenats.Desired("bench", "bare", spec.Resolve()))
		if err != nil {
			return err
		}
		it, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(250, 2<<20),
			jetstream.PullExpiry(10*time.Second), jetstream.PullHeartbeat(3*time.Second))
		if err != nil {
			return err
		}
		defer it.Stop()
		for range messages {
			m, err := it.Next()
			if err != nil {
				return err
			}
			if err := m.Ack(); err != nil {
				return err
			}
		}
		return nil
	}
	futures := make([]jetstream.PubAckFuture, 0, messages)
	for range messages {
		f, err := js.PublishAsync(prefix+".m", payload)
		if err != nil {
			p.cleanup()
			return place{}, err
		}
		futures = append(futures, f)
	}
	for _, f := range futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			p.cleanup()
			return place{}, err
		}
	}
	return p, nil
}
