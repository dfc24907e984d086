package messaging

// One attempt of one message as a handler sees it, and the one settle path (docs/semantics.md
// S1–S6). Backends make deliveries only with NewDelivery; the settlement state sits behind a
// pointer, so every copy agrees and the first settlement wins. Settle / SettleWith are the
// only way a settlement reaches a backend: the handler's Ack/Nack/NackAfter, the bus after the
// handler returns, and the conformance rows. It must not talk to a broker itself (that is the
// backend's OnSettle).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"
)

// Decision is what a handler made of an attempt.
type Decision int

const (
	Ack Decision = iota
	Nack
	Silent
)

func (d Decision) String() string {
	return [...]string{"Ack", "Nack", "Silent"}[d]
}

// ActionKind is what the backend is asked to do.
type ActionKind int

const (
	// ActAck accepts the attempt.
	ActAck ActionKind = iota
	// ActDecline asks for the message again after Delay.
	ActDecline
	// ActTerminate drops a message declined on its last attempt (counted Exhausted).
	ActTerminate
)

// BrokerAction is one settlement as the backend performs it.
type BrokerAction struct {
	Kind  ActionKind
	Delay time.Duration
}

// Performed says how the backend performed a settlement.
type Performed int

const (
	AsAsked Performed = iota
	// DelayShortened: the decline comes back sooner than asked (C10).
	DelayShortened
)

// Refusal is a settlement the backend could not perform (C6); Stranded when the broker cannot
// be asked to try again (C8).
type Refusal struct {
	Reason   string
	Stranded bool
}

func (r *Refusal) Error() string { return r.Reason }

// OnSettle is the backend's side of one delivery.
type OnSettle interface {
	// Settle performs an ack, a decline or a termination.
	Settle(ctx context.Context, a BrokerAction) (Performed, *Refusal)
	// Progress extends the broker's lease (ExtendLease).
	Progress(ctx context.Context) *Refusal
	// Release gives an unsettled attempt back at close.
	Release(ctx context.Context)
}

// DeliveryOptions is what a backend hands NewDelivery.
type DeliveryOptions struct {
	Subject  string
	Headers  []Header
	Payload  []byte
	Attempt  int
	OnSettle OnSettle
}

// The settlement errors.
var (
	// ErrAlreadySettled: a second settlement of one attempt, from any copy (S2).
	ErrAlreadySettled = errors.New("the delivery was already settled: the first settlement wins")
	// ErrReleased: a settlement after the bus gave the attempt up at close (its handler ran
	// past the close grace); the broker owes the message back, and nothing is counted.
	ErrReleased = errors.New("the delivery was released at close: the broker offers it again; nothing recorded")
)

// DelayError is a NackAfter refused before anything was recorded (B3).
type DelayError struct{ msg string }

func (e *DelayError) Error() string { return e.msg }

const (
	fateOpen int32 = iota
	fateDelivered
	fateReleased
)

type state struct {
	sub      *Sub
	onSettle OnSettle
	// env is the envelope as read: at once when there are transport headers (they may
	// contradict it: a ForeignConflict), else when first asked for (most handlers never do).
	env        atomic.Pointer[parsed]
	subject    string
	headers    []Header
	payload    []byte
	attempt    int
	generation uint64
	// keeper keeps the lease while the handler runs; ran is set when the handler returned
	// (the bus's loop, dispatch.go).
	keeper  atomic.Pointer[leaseKeeper]
	settled atomic.Bool
	ran     atomic.Bool
	fate    atomic.Int32
}

// Delivery is one attempt of one message. Copies share one settlement state.
type Delivery struct{ s *state }

// NewDelivery is the one way to make a delivery: it counts the attempt Offered (and a
// ForeignConflict when its transport headers contradict its envelope).
func NewDelivery(sub *Sub, o DeliveryOptions) Delivery {
	var env *parsed
	if len(o.Headers) > 0 {
		env = parseEnvelope(o.Headers, o.Payload)
	}
	gen := sub.offer(env != nil && !env.foreign.Empty())
	s := &state{
		sub: sub, subject: o.Subject, headers: o.Headers, payload: o.Payload,
		attempt: max(o.Attempt, 1), generation: gen, onSettle: o.OnSettle,
	}
	if env != nil {
		s.env.Store(env)
	}
	return Delivery{s}
}

// envelope is the delivery's envelope, read the first time it is asked for.
func (s *state) envelope() *parsed {
	if p := s.env.Load(); p != nil {
		return p
	}
	s.env.CompareAndSwap(nil, parseEnvelope(s.headers, s.payload))
	return s.env.Load()
}

func (d Delivery) Subscription() string { return d.s.sub.Name() }
func (d Delivery) Subject() string      { return d.s.subject }
func (d Delivery) Payload() []byte      { return d.s.payload }
func (d Delivery) Headers() []Header    { return d.s.headers }

// Header is one transport header, by case-insensitive name.
func (d Delivery) Header(name string) (string, bool) { return header(d.s.headers, name) }

// Attempt is 1 for the first attempt; each redelivery arrives with a higher one.
func (d Delivery) Attempt() int { return d.s.attempt }

// Event is the event's identity as its envelope states it.
func (d Delivery) Event() Event { return d.s.envelope().event }

// Foreign is the transport headers that contradicted the envelope.
func (d Delivery) Foreign() Foreign { return d.s.envelope().foreign }

// Settled reports whether any copy has settled it.
func (d Delivery) Settled() bool { return d.s.settled.Load() }

// Decode decodes the event's data (the payload, CloudEvents data, or MassTransit message) from JSON.
func (d Delivery) Decode(v any) error {
	if err := json.Unmarshal(d.s.envelope().data, v); err != nil {
		return fmt.Errorf("cannot decode the event data of %q: %w", d.s.subject, err)
	}
	return nil
}

// Ack accepts the delivery.
func (d Delivery) Ack() error { return Settle(context.Background(), d, Ack) }

// Nack declines the delivery; under AtLeastOnce it comes back after the backoff schedule.
func (d Delivery) Nack() error { return Settle(context.Background(), d, Nack) }

// NackAfter declines the delivery and asks that it not come back before delay (zero: at
// once). A negative delay, one above the ceiling, or any where there is no ceiling returns an
// error and records nothing.
func (d Delivery) NackAfter(delay time.Duration) error {
	return SettleWith(context.Background(), d, delay)
}

func (d Delivery) count(k counter) { d.s.sub.count(d.s.generation, k) }

// complete is the bus after the handler returned (or panicked): Delivered, and Silent unless
// the handler settled. False when the attempt had already been released.
func (d Delivery) complete(ctx context.Context) bool {
	if !d.s.fate.CompareAndSwap(fateOpen, fateDelivered) {
		return false
	}
	d.count(cDelivered)
	if d.Settled() {
		return true
	}
	if err := Settle(ctx, d, Silent); err != nil && !errors.Is(err, ErrAlreadySettled) {
		slog.Warn("silent settlement failed", "subscription", d.Subscription(), "error", err)
	}
	return true
}

// release gives an attempt up before its handler returned (closing): Released under
// AtLeastOnce (the backend owes it back), Lost under AtMostOnce.
func (d Delivery) release(ctx context.Context) {
	if !d.s.fate.CompareAndSwap(fateOpen, fateReleased) {
		return
	}
	if d.s.sub.Policy.AtLeastOnce() {
		d.count(cReleased)
		// Taking the settlement slot keeps a handler still running from settling it later.
		if d.s.settled.CompareAndSwap(false, true) {
			d.s.onSettle.Release(ctx)
		}
	} else {
		d.count(cLost)
		d.s.settled.Store(true)
	}
}

// Settle settles a delivery: the one path the handler, the bus (silence) and the conformance
// rows take. The first settlement wins; a later one, from any copy, returns ErrAlreadySettled.
func Settle(ctx context.Context, d Delivery, decision Decision) error {
	return settle(ctx, d, decision, nil)
}

// SettleWith declines a delivery with a delay (NackAfter), checked against the ceiling first.
func SettleWith(ctx context.Context, d Delivery, delay time.Duration) error {
	return settle(ctx, d, Nack, &delay)
}

func settle(ctx context.Context, d Delivery, decision Decision, delay *time.Duration) error {
	s := d.s
	p := &s.sub.Policy
	if delay != nil {
		ceiling, ok := p.NackCeiling()
		switch {
		case *delay < 0:
			return &DelayError{fmt.Sprintf("NackAfter of a negative delay (%s) is refused (nothing recorded; call Nack() or NackAfter(0))", *delay)}
		case !ok:
			return &DelayError{fmt.Sprintf("NackAfter is not allowed on subscription %q: it has neither MaxNackDelay nor Backoff (nothing recorded; call Nack() instead, or set MaxNackDelay)", s.sub.Name())}
		case *delay > ceiling:
			return &DelayError{fmt.Sprintf("NackAfter(%s) is above this subscription's ceiling of %s (nothing recorded; ask for less, or call Nack())", *delay, ceiling)}
		}
	}
	if !s.settled.CompareAndSwap(false, true) {
		if s.fate.Load() == fateReleased {
			return ErrReleased
		}
		slog.Warn("second settlement refused: a handler that settles twice has a bug",
			"subscription", s.sub.Name(), "subject", s.subject, "attempt", s.attempt, "decision", decision)
		return ErrAlreadySettled
	}
	d.count([...]counter{cAcked, cNacked, cSilent}[decision])
	if !p.AtLeastOnce() {
		return nil // AtMostOnce: recorded, never acted on.
	}
	action := BrokerAction{Kind: ActAck}
	if decision != Ack {
		if p.MaxDeliver > 0 && s.attempt >= p.MaxDeliver {
			d.count(cExhausted)
			slog.Warn("declined on its last attempt: counted Exhausted (data loss)",
				"subscription", s.sub.Name(), "subject", s.subject, "attempt", s.attempt)
			action = BrokerAction{Kind: ActTerminate}
		} else if delay != nil {
			action = BrokerAction{Kind: ActDecline, Delay: *delay}
		} else {
			action = BrokerAction{Kind: ActDecline, Delay: p.DeclineDelay(s.attempt)}
		}
	}
	performed, refusal := s.onSettle.Settle(ctx, action)
	if refusal != nil {
		d.count(cRefused)
		if refusal.Stranded && action.Kind == ActDecline {
			d.count(cStranded)
		}
		slog.Warn("the backend refused a settlement", "subscription", s.sub.Name(), "subject", s.subject, "reason", refusal.Reason)
		return fmt.Errorf("the backend could not perform the settlement: %w", refusal)
	}
	if performed == DelayShortened {
		d.count(cDelayShortened)
	}
	return nil
}
