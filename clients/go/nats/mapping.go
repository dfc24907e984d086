package nats

// The one spec → consumer mapping of this runtime (the Rust runtime's `nats::mapping`): the
// consumer's name, and the consumer a code-defined subscription makes for itself. It must not
// talk to the server.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
)

// The operator's metadata keys on a consumer it made.
const (
	OwnerKey = "settle.dev/subscription"
	UIDKey   = "settle.dev/uid"
)

// codeDefinedInactiveThreshold: how long the server keeps a consumer a code-defined
// AtMostOnce subscription made under a derived name once nobody reads it.
const codeDefinedInactiveThreshold = 5 * time.Minute

// ConsumerName is the consumer Settle uses for a Subscription: its durable name, or (only
// possible under AtMostOnce) settle_<namespace>_<name> with `.` as `_`.
func ConsumerName(namespace, name string, p messaging.Policy) string {
	if p.DurableName != "" {
		return p.DurableName
	}
	return fmt.Sprintf("settle_%s_%s", namespace, strings.ReplaceAll(name, ".", "_"))
}

// Desired is the consumer a code-defined subscription makes (the operator makes the same for
// a Subscription resource, and marks it).
func Desired(namespace, name string, p messaging.Policy) jetstream.ConsumerConfig {
	alo := p.AtLeastOnce()
	c := jetstream.ConsumerConfig{
		Name:          ConsumerName(namespace, name, p),
		Durable:       ConsumerName(namespace, name, p),
		Description:   fmt.Sprintf("settle subscription %s/%s", namespace, name),
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckNonePolicy,
		FilterSubject: p.Pattern,
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
		MaxDeliver:    -1,
		Metadata:      map[string]string{OwnerKey: namespace + "/" + name},
	}
	if p.DurableName == "" {
		c.DeliverPolicy = jetstream.DeliverNewPolicy
		c.InactiveThreshold = codeDefinedInactiveThreshold
	}
	if alo {
		c.AckPolicy = jetstream.AckExplicitPolicy
		c.AckWait = p.AckWait
		if p.MaxDeliver > 0 {
			c.MaxDeliver = p.MaxDeliver
		}
		c.MaxAckPending = p.MaxInFlight
	}
	return c
}

// resolveStream is the named stream, or the one stream whose subjects cover pattern.
func resolveStream(ctx context.Context, js jetstream.JetStream, explicit, pattern string) (string, error) {
	if explicit != "" {
		if _, err := js.Stream(ctx, explicit); err != nil {
			return "", fmt.Errorf("stream %s: %w", explicit, err)
		}
		return explicit, nil
	}
	names := js.StreamNames(ctx, jetstream.WithStreamListSubject(pattern))
	var found []string
	for n := range names.Name() {
		found = append(found, n)
	}
	if err := names.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
		return "", fmt.Errorf("listing the streams of %s: %w", pattern, err)
	}
	switch len(found) {
	case 0:
		return "", fmt.Errorf("no stream carries subjects matching %q: create one (the platform's job), or name it in spec.stream", pattern)
	case 1:
		return found[0], nil
	default:
		return "", fmt.Errorf("more than one stream carries %q (%s): name the one to use in spec.stream", pattern, strings.Join(found, ", "))
	}
}
