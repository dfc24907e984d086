// Package messaging is Settle's handler runtime for Go: a Bus runs handlers for subscriptions
// on a backend (memory, NATS JetStream), settles every delivery exactly once, counts what
// happened to it (docs/semantics.md), and reports the counts to the operator in the stats
// report (docs/stats-report.md), the same account the Rust runtime `settle::bus` keeps.
//
// This file holds the subscription spec and its defaults. It must not talk to a broker.
package messaging

import (
	"context"
	"math"
	"time"
)

// Mode says what the bus does with a settlement (docs/semantics.md M1–M4).
type Mode int

const (
	// AtMostOnce, the default: every settlement is recorded, none is acted on.
	AtMostOnce Mode = iota
	// AtLeastOnce: a Nack, or silence, brings the message back, up to MaxDeliver attempts.
	AtLeastOnce
)

func (m Mode) String() string {
	if m == AtLeastOnce {
		return "AtLeastOnce"
	}
	return "AtMostOnce"
}

// Shape says who sees a message.
type Shape int

// Fanout: each subscription sees every message.
const Fanout Shape = 0

// SlowHandler says what happens when a handler runs past AckWait (docs/semantics.md H1–H5).
type SlowHandler int

const (
	// ExtendLease, the default, keeps the message with its handler up to MaxProcessingTime.
	ExtendLease SlowHandler = iota
	// Redeliver lets the message go after AckWait while its handler may still run.
	Redeliver
)

// Backoff is the wait after each decline: Initial × Multiplier^(n−1), capped at Max (B2).
// The zero value is no schedule.
type Backoff struct {
	Initial    time.Duration
	Max        time.Duration
	Multiplier float64 // 2 unless set
}

// Set reports whether the schedule is given.
func (b Backoff) Set() bool { return b != Backoff{} }

// Handler handles one delivery. Its returned error is an outcome, separate from settlement (S3).
type Handler func(ctx context.Context, d Delivery) error

// The defaults of the fields left zero (docs/semantics.md).
const (
	DefaultAckWait           = 30 * time.Second
	DefaultMaxProcessingTime = 5 * time.Minute
	DefaultMaxInFlight       = 250
)

// SubscriptionSpec is one subscription: the seed's fields, with the Subscription resource's
// names and meaning. Zero means unset (the default) for every field.
type SubscriptionSpec struct {
	Name              string
	Pattern           string
	Shape             Shape
	Mode              Mode
	MaxDeliver        int
	DurableName       string
	Backoff           Backoff
	MaxNackDelay      time.Duration
	SlowHandler       SlowHandler
	AckWait           time.Duration
	MaxProcessingTime time.Duration
	MaxInFlight       int
	// Stream names the JetStream stream; by default the one whose subjects cover Pattern.
	Stream string
	// OwnedByOperator binds to the consumer (or queue) the Settle operator made for the
	// Subscription of this Name, waiting while it does not exist, instead of making one.
	OwnedByOperator bool
	Handler         Handler

	// set records which optional fields were given explicitly (for the rules' warnings).
	slowHandlerSet bool
}

// WithSlowHandler sets SlowHandler explicitly (admission warns about some explicit choices).
func (s SubscriptionSpec) WithSlowHandler(h SlowHandler) SubscriptionSpec {
	s.SlowHandler = h
	s.slowHandlerSet = true
	return s
}

// Policy is a spec with its defaults filled in: what the runtime and backends act on.
type Policy struct {
	Name              string
	Pattern           string
	Mode              Mode
	MaxDeliver        int // 0: no limit
	DurableName       string
	Backoff           Backoff
	MaxNackDelay      time.Duration
	SlowHandler       SlowHandler
	AckWait           time.Duration
	MaxProcessingTime time.Duration
	MaxInFlight       int
	Stream            string
	OwnedByOperator   bool
}

// Resolve fills the defaults in.
func (s SubscriptionSpec) Resolve() Policy {
	p := Policy{
		Name: s.Name, Pattern: s.Pattern, Mode: s.Mode, MaxDeliver: s.MaxDeliver,
		DurableName: s.DurableName, Backoff: s.Backoff, MaxNackDelay: s.MaxNackDelay,
		SlowHandler: s.SlowHandler, AckWait: s.AckWait, MaxProcessingTime: s.MaxProcessingTime,
		MaxInFlight: s.MaxInFlight, Stream: s.Stream, OwnedByOperator: s.OwnedByOperator,
	}
	if p.AckWait == 0 {
		p.AckWait = DefaultAckWait
	}
	if p.MaxProcessingTime == 0 {
		p.MaxProcessingTime = DefaultMaxProcessingTime
	}
	if p.MaxInFlight == 0 {
		p.MaxInFlight = DefaultMaxInFlight
	}
	if p.Backoff.Set() && p.Backoff.Multiplier == 0 {
		p.Backoff.Multiplier = 2
	}
	return p
}

// AtLeastOnce reports whether declines are acted on.
func (p Policy) AtLeastOnce() bool { return p.Mode == AtLeastOnce }

// NackCeiling is the longest NackAfter allowed: MaxNackDelay, else Backoff.Max; none is
// allowed without either (B3).
func (p Policy) NackCeiling() (time.Duration, bool) {
	if p.MaxNackDelay > 0 {
		return p.MaxNackDelay, true
	}
	if p.Backoff.Set() {
		return p.Backoff.Max, true
	}
	return 0, false
}

// DeclineDelay is the wait after declining attempt n: the schedule's, else none (B1, B2).
func (p Policy) DeclineDelay(attempt int) time.Duration {
	if !p.Backoff.Set() {
		return 0
	}
	return ScheduleDelay(p.Backoff, attempt)
}

// ScheduleDelay is initial × multiplier^(attempt−1), capped at max (B2).
func ScheduleDelay(b Backoff, attempt int) time.Duration {
	exp := min(max(attempt-1, 0), 1024)
	secs := b.Initial.Seconds() * math.Pow(b.Multiplier, float64(exp))
	if math.IsInf(secs, 0) || math.IsNaN(secs) || secs >= b.Max.Seconds() {
		return b.Max
	}
	return min(time.Duration(secs*float64(time.Second)), b.Max)
}
