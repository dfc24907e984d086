package conformance_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/conformance"
	"settle.dev/messaging/memory"
	settlenats "settle.dev/messaging/nats"
)

var seq atomic.Uint32

// runAll runs every scene of the shared file on scope, side by side, and fails each that
// differs from what the file expects on this broker.
func runAll(t *testing.T, scope conformance.Scope) {
	f, err := conformance.Load()
	if err != nil {
		t.Fatal(err)
	}
	b, err := scope.Backend()
	if err != nil {
		t.Fatal(err)
	}
	caps := b.Capabilities()
	for n, sc := range f.Scenes {
		t.Run(sc.Name, func(t *testing.T) {
			t.Parallel()
			if sc.Requires == "delaysRedelivery" && !caps.DelaysRedelivery {
				t.Logf("not for %s: the scene needs delaysRedelivery (K1)", scope.Broker())
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			got, want, err := conformance.Run(ctx, scope, sc, n)
			if err != nil {
				t.Fatalf("%s on %s: %v", sc.Name, scope.Broker(), err)
			}
			for i := range want {
				if d := conformance.Check(got[i], want[i]); d != "" {
					t.Errorf("%s on %s, phase %d (rules %s): %s", sc.Name, scope.Broker(), i+1, strings.Join(sc.Rules, ", "), d)
				}
			}
		})
	}
}

type memoryScope struct{ b *memory.Broker }

func (s memoryScope) Broker() string                      { return "memory" }
func (s memoryScope) Backend() (messaging.Backend, error) { return s.b, nil }
func (s memoryScope) Base(n int) messaging.SubscriptionSpec {
	return messaging.SubscriptionSpec{Name: fmt.Sprintf("scene-%d", n), Pattern: fmt.Sprintf("scene.%d.>", n), DurableName: fmt.Sprintf("scene-%d", n)}
}
func (s memoryScope) Send(ctx context.Context, b messaging.Backend, n int, body []byte, hs []messaging.Header) error {
	return b.Publish(ctx, fmt.Sprintf("scene.%d.m", n), body, hs)
}

func TestTheSharedScenesHoldOnMemory(t *testing.T) {
	runAll(t, memoryScope{memory.New()})
}

// natsScope is a stream of its own on the environment's nats-server.
type natsScope struct {
	url, prefix string
}

func (s natsScope) Broker() string { return "nats" }
func (s natsScope) Backend() (messaging.Backend, error) {
	return settlenats.Connect(s.url, "conformance")
}
func (s natsScope) Base(n int) messaging.SubscriptionSpec {
	name := fmt.Sprintf("%s-%d", strings.ReplaceAll(s.prefix, ".", "-"), n)
	return messaging.SubscriptionSpec{Name: name, Pattern: fmt.Sprintf("%s.%d.>", s.prefix, n), DurableName: name}
}
func (s natsScope) Send(ctx context.Context, b messaging.Backend, n int, body []byte, hs []messaging.Header) error {
	return b.Publish(ctx, fmt.Sprintf("%s.%d.m", s.prefix, n), body, hs)
}

// env is an environment variable the tests need: `make env-up` (or `make test`) exports it.
func env(t *testing.T, name string) string {
	if testing.Short() {
		t.Skip("needs the environment: `make test` runs it (`make check` runs -short)")
	}
	v := os.Getenv(name)
	if v == "" {
		t.Fatalf("%s is not set: start the environment (`make env-up`, then `source target/env/settle.env`); `make test` does both", name)
	}
	return v
}

func TestTheSharedScenesHoldOnNATS(t *testing.T) {
	url := env(t, "SETTLE_NATS_URL")
	prefix := fmt.Sprintf("goconf.%d.%d", os.Getpid(), seq.Add(1))
	b, err := settlenats.Connect(url, "conformance")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	stream := strings.ReplaceAll(prefix, ".", "_")
	if _, err := b.JetStream().CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = b.JetStream().DeleteStream(context.Background(), stream)
		b.Close()
	})
	runAll(t, natsScope{url: url, prefix: prefix})
}
