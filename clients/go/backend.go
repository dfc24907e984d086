package messaging

// What a backend gives the bus (the seam): its capabilities, a consumer per subscription, a
// publish, and where stats reports go. Interfaces and capability rows only; it must not count
// (the settle path does).

import (
	"context"
	"time"
)

// AckTimeout says who hands a slow handler's message on (docs/semantics.md K6).
type AckTimeout string

const (
	AckTimeoutPerSubscription AckTimeout = "PerSubscription"
	AckTimeoutBrokerWide      AckTimeout = "BrokerWide"
	AckTimeoutNever           AckTimeout = "Never"
)

// Capabilities is what a backend can honour (docs/semantics.md K1–K10), the same rows as the
// Rust runtime's and the Backend resource's status.
type Capabilities struct {
	DelaysRedelivery             bool
	MaxRedeliveryDelay           time.Duration // 0: no limit
	RestartCanSpendUnseenAttempt bool
	SubjectNamesQueue            bool
	AckTimeout                   AckTimeout
	MaxInFlight                  int // 0: no limit
	MaxDeliverFixed              bool
	NamedStreams                 bool
}

// CapabilitiesOf is a backend kind's row: nats, memory, sqs or rabbitmq.
func CapabilitiesOf(kind string) Capabilities {
	switch kind {
	case "nats":
		return Capabilities{DelaysRedelivery: true, RestartCanSpendUnseenAttempt: true,
			AckTimeout: AckTimeoutPerSubscription, NamedStreams: true}
	case "sqs":
		return Capabilities{DelaysRedelivery: true, MaxRedeliveryDelay: 12 * time.Hour,
			RestartCanSpendUnseenAttempt: true, SubjectNamesQueue: true, AckTimeout: AckTimeoutPerSubscription}
	case "rabbitmq":
		return Capabilities{RestartCanSpendUnseenAttempt: true, AckTimeout: AckTimeoutBrokerWide,
			MaxInFlight: 65535, MaxDeliverFixed: true}
	default:
		return Capabilities{DelaysRedelivery: true, AckTimeout: AckTimeoutNever, NamedStreams: true}
	}
}

// SettlementWaits is what a Consumer whose settlements each wait for the broker's answer (an
// HTTP call on SQS) implements, returning true: the bus then runs each of its handlers on a
// goroutine of its own at once, instead of inline until it has run past the handoff (a
// handler that acks would always run past it, and the next delivery would wait that long).
type SettlementWaits interface{ SettlementWaits() bool }

// Consumer is one subscription's source of deliveries.
type Consumer interface {
	// Next waits for the next delivery; false when the consumer ended or ctx is done.
	Next(ctx context.Context) (Delivery, bool)
	// Stop stops fetching (before attempts still held are released).
	Stop(ctx context.Context)
	// Retire ends the consumer: later settlements of its deliveries are refused.
	Retire(ctx context.Context)
}

// StatsSink is where stats reports go (docs/stats-report.md).
type StatsSink interface {
	Put(ctx context.Context, key string, body []byte) error
}

// Backend is a broker as the bus uses it.
type Backend interface {
	// Kind is nats, rabbitmq, sqs or memory (the report's "backend").
	Kind() string
	Capabilities() Capabilities
	// Open binds the subscription to its consumer (or makes one) and starts fetching.
	Open(ctx context.Context, sub *Sub) (Consumer, error)
	Publish(ctx context.Context, subject string, payload []byte, headers []Header) error
	// HandsOnSlowHandlers reports whether the broker hands a message on after AckWait.
	HandsOnSlowHandlers() bool
	// StatsSink is where this backend's stats reports go; nil for none.
	StatsSink() StatsSink
	// ReadMark reads the object mark of the operator's consumer the subscription is bound to
	// again ("" when there is none or it cannot be read).
	ReadMark(ctx context.Context, sub *Sub) string
}

// Sleep waits d, or until ctx ends: false when ctx ended first. The backends' waits (for an
// operator's consumer, a retry, a pause poll) all take it, so each ends with its subscription.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
