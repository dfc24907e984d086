// Command account-app is an application on the Go runtime whose handler behaves as told, for
// the account's tests: the Go twin of the Rust runtime's examples/account_app.rs, with the same
// environment and the same lines, so a test runs either (or both at once) the same way. It
// binds to the consumer the operator made for a Subscription and reports its counters.
//
//   - SETTLE_NATS_URL: the broker is NATS; without it, SETTLE_RABBITMQ_URL: RabbitMQ (binding on
//     and publishing to amq.topic); without either, SETTLE_SQS_ENDPOINT: SQS at that endpoint
//     (ElasticMQ; any region and keys), with the queue prefix SETTLE_SQS_QUEUE_PREFIX.
//   - SETTLE_SUBSCRIPTION_FILE: the Subscription manifest (with its namespace).
//   - SETTLE_APP_HANDLER: ack (prints `acked <body>`), demo (acks orders, declines a body
//     containing `bad`, returns silently once on one containing `slow`), nack, ack-even-silent-odd, nack-first
//     (declines a message's first attempt, acks the others, printing `seen <body> <attempt>`),
//     model (the fault campaign's handler, docs/guide/chaos.md: the same draw as the Rust
//     app's, appending `<id> <attempt> <answer> <unix ms>` to SETTLE_APP_MODEL_LOG).
//   - SETTLE_APP_HANDLE_MS: how long nack and nack-first work before they answer (default 0).
//   - SETTLE_REPORT_INTERVAL (default 200ms): how often counters are reported.
//
// It prints `ready` once subscribed; SIGTERM is the graceful stop (handlers finish, the last
// report is confirmed), then it prints `closed`.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/nats"
	"settle.dev/messaging/rabbitmq"
	"settle.dev/messaging/sqs"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "account-app:", err)
		os.Exit(1)
	}
}

func run() error {
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, nil)))
	path := os.Getenv("SETTLE_SUBSCRIPTION_FILE")
	if path == "" {
		return errors.New("set SETTLE_SUBSCRIPTION_FILE to a Subscription manifest")
	}
	text, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	ns, spec, err := messaging.SpecFromManifest(text)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	report := 200 * time.Millisecond
	if v := os.Getenv("SETTLE_REPORT_INTERVAL"); v != "" {
		if report, err = time.ParseDuration(v); err != nil {
			return fmt.Errorf("SETTLE_REPORT_INTERVAL=%q: %w", v, err)
		}
	}
	h, err := handler(os.Getenv("SETTLE_APP_HANDLER"))
	if err != nil {
		return err
	}
	spec.Handler = h
	b, closeBackend, err := backend(ns)
	if err != nil {
		return err
	}
	defer closeBackend()
	bus := messaging.New(b, messaging.Options{Namespace: ns, ReportInterval: report})
	stop, cancel := messaging.StopSignal()
	defer cancel()
	if err := bus.Subscribe(stop, spec); err != nil {
		return err
	}
	say("ready")
	<-stop.Done()
	bus.Close()
	say("closed")
	return nil
}

// backend is the broker the environment names: NATS first, then RabbitMQ, then SQS.
func backend(ns string) (messaging.Backend, func(), error) {
	if url := os.Getenv("SETTLE_NATS_URL"); url != "" {
		b, err := nats.Connect(url, ns)
		if err != nil {
			return nil, nil, err
		}
		return b, b.Close, nil
	}
	if url := os.Getenv("SETTLE_RABBITMQ_URL"); url != "" {
		b, err := rabbitmq.Connect(url)
		if err != nil {
			return nil, nil, err
		}
		return b, b.Close, nil
	}
	if endpoint := os.Getenv("SETTLE_SQS_ENDPOINT"); endpoint != "" {
		b, err := sqs.Connect(sqs.Settings{Region: "elasticmq", Endpoint: endpoint, AccessKeyID: "test", SecretAccessKey: "test",
			QueuePrefix: os.Getenv("SETTLE_SQS_QUEUE_PREFIX")})
		if err != nil {
			return nil, nil, err
		}
		return b.WithLongPoll(1), func() {}, nil
	}
	return nil, nil, errors.New("set SETTLE_NATS_URL, SETTLE_RABBITMQ_URL or SETTLE_SQS_ENDPOINT")
}

var out sync.Mutex

func say(format string, args ...any) {
	out.Lock()
	defer out.Unlock()
	fmt.Printf(format+"\n", args...)
}

func handleMs() time.Duration {
	ms, _ := strconv.Atoi(os.Getenv("SETTLE_APP_HANDLE_MS"))
	return time.Duration(ms) * time.Millisecond
}

func work(ctx context.Context, d time.Duration) {
	if d > 0 {
		messaging.Sleep(ctx, d)
	}
}

func handler(name string) (messaging.Handler, error) {
	wait := handleMs()
	switch name {
	case "ack":
		return func(_ context.Context, d messaging.Delivery) error {
			err := d.Ack()
			say("acked %s", d.Payload())
			return err
		}, nil
	case "demo":
		return func(_ context.Context, d messaging.Delivery) error {
			body := string(d.Payload())
			switch {
			case strings.Contains(body, "bad"):
				return d.Nack()
			case strings.Contains(body, "slow") && d.Attempt() == 1:
				return nil
			}
			return d.Ack()
		}, nil
	case "nack":
		return func(ctx context.Context, d messaging.Delivery) error {
			work(ctx, wait)
			return d.Nack()
		}, nil
	case "ack-even-silent-odd":
		return func(_ context.Context, d messaging.Delivery) error {
			n, _ := strconv.Atoi(strings.TrimSpace(string(d.Payload())))
			if n%2 == 0 {
				return d.Ack()
			}
			return nil
		}, nil
	case "nack-first":
		return func(ctx context.Context, d messaging.Delivery) error {
			say("seen %s %d", d.Payload(), d.Attempt())
			work(ctx, wait)
			if d.Attempt() == 1 {
				return d.Nack()
			}
			return d.Ack()
		}, nil
	case "model":
		return model()
	}
	return nil, fmt.Errorf("SETTLE_APP_HANDLER=%q: use ack, demo, nack, ack-even-silent-odd, nack-first or model", name)
}
