package conformance_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/conformance"
	"settle.dev/messaging/memory"
	settlenats "settle.dev/messaging/nats"
	"settle.dev/messaging/rabbitmq"
	"settle.dev/messaging/sqs"
)

var seq atomic.Uint32

// runAll runs every scene of the shared file on scope, side by side, and fails each that
// differs from what the file expects on this broker.
func runAll(t *testing.T, scope conformance.Scope) {
	runEach(t, func(int) conformance.Scope { return scope })
}

// runEach runs scene n on scopeOf(n).
func runEach(t *testing.T, scopeOf func(n int) conformance.Scope) {
	f, err := conformance.Load()
	if err != nil {
		t.Fatal(err)
	}
	b, err := scopeOf(0).Backend()
	if err != nil {
		t.Fatal(err)
	}
	caps := b.Capabilities()
	if c, ok := b.(interface{ Close() }); ok {
		c.Close()
	}
	for n, sc := range f.Scenes {
		scope := scopeOf(n)
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
	t.Parallel()
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
	t.Parallel()
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

// rabbitScope is a topic exchange of its own per scene on the environment's RabbitMQ: the
// scene's queue is bound to it by "orders.>", as a Backend's exchange.
type rabbitScope struct {
	url, tag string
}

func (s rabbitScope) Broker() string { return "rabbitmq" }
func (s rabbitScope) Backend() (messaging.Backend, error) {
	b, err := rabbitmq.Connect(s.url)
	if err != nil {
		return nil, err
	}
	return b.WithExchange("settle.gotest." + s.tag), nil
}
func (s rabbitScope) Base(n int) messaging.SubscriptionSpec {
	name := fmt.Sprintf("goconf-%s-%d", s.tag, n)
	return messaging.SubscriptionSpec{Name: name, Pattern: "orders.>", DurableName: name}
}
func (s rabbitScope) Send(ctx context.Context, b messaging.Backend, n int, body []byte, hs []messaging.Header) error {
	return b.Publish(ctx, fmt.Sprintf("orders.%d", n), body, hs)
}

func TestTheSharedScenesHoldOnRabbitMQ(t *testing.T) {
	t.Parallel()
	url := env(t, "SETTLE_RABBITMQ_URL")
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	f, err := conformance.Load()
	if err != nil {
		t.Fatal(err)
	}
	run := seq.Add(1)
	var scopes []rabbitScope
	for n := range f.Scenes {
		tag := fmt.Sprintf("%d-%d-%d", os.Getpid(), run, n)
		if err := ch.ExchangeDeclare("settle.gotest."+tag, "topic", false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		scopes = append(scopes, rabbitScope{url: url, tag: tag})
	}
	t.Cleanup(func() {
		for n, s := range scopes {
			_, _ = ch.QueueDelete(s.Base(n).DurableName, false, false, false)
			_ = ch.ExchangeDelete("settle.gotest."+s.tag, false, false)
		}
		_ = conn.Close()
	})
	runEach(t, func(n int) conformance.Scope { return scopes[n] })
}

// sqsScope is a queue prefix of its own per scene on the environment's ElasticMQ: the scene's
// subscription `scene` receives from queue `<prefix>scene` (a subject is a queue's name).
type sqsScope struct {
	endpoint, prefix string
}

func (s sqsScope) Broker() string { return "sqs" }
func (s sqsScope) Backend() (messaging.Backend, error) {
	b, err := sqs.Connect(sqs.Settings{Region: "elasticmq", Endpoint: s.endpoint, AccessKeyID: "test", SecretAccessKey: "test", QueuePrefix: s.prefix})
	if err != nil {
		return nil, err
	}
	return b.WithLongPoll(1), nil
}
func (s sqsScope) Base(int) messaging.SubscriptionSpec {
	return messaging.SubscriptionSpec{Name: "scene", Pattern: "scene", DurableName: "scene"}
}
func (s sqsScope) Send(ctx context.Context, b messaging.Backend, _ int, body []byte, hs []messaging.Header) error {
	return b.Publish(ctx, "scene", body, hs)
}

func TestTheSharedScenesHoldOnSQS(t *testing.T) {
	t.Parallel()
	endpoint := env(t, "SETTLE_SQS_ENDPOINT")
	f, err := conformance.Load()
	if err != nil {
		t.Fatal(err)
	}
	run := seq.Add(1)
	var scopes []sqsScope
	for n := range f.Scenes {
		scopes = append(scopes, sqsScope{endpoint: endpoint, prefix: fmt.Sprintf("goconf-%d-%d-%d-", os.Getpid(), run, n)})
	}
	t.Cleanup(func() {
		b, err := scopes[0].Backend()
		if err != nil {
			return
		}
		c := b.(*sqs.Broker).Client()
		for _, s := range scopes {
			out, err := c.ListQueues(context.Background(), &awssqs.ListQueuesInput{QueueNamePrefix: &s.prefix})
			if err != nil {
				continue
			}
			for _, u := range out.QueueUrls {
				_, _ = c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: &u})
			}
		}
	})
	runEach(t, func(n int) conformance.Scope { return scopes[n] })
}
