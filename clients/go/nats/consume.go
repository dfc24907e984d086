package nats

// Consuming from JetStream: the pull consumer a subscription binds to (made from the mapping
// for a code-defined subscription; waited for when the operator makes it), each message turned
// into a Delivery, and its settlement with JetStream's ack protocol, as the Rust runtime sends
// it (docs/semantics.md J1–J7):
//   - Ack: +ACK, fire-and-forget. A late ack after this process retired the consumer is Refused.
//   - Decline: a bare -NAK for a zero delay, else -NAK {"delay":<ns>}, sent as a request so the
//     server confirms it: when nobody answers and the consumer is gone, Refused and Stranded.
//   - Last attempt declined: +TERM (the runtime counted it Exhausted).
//   - ExtendLease: +WPI; release at close: a bare -NAK.
// It must not count anything (the settle path does) nor change a consumer the operator owns.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
)

const (
	// leaderlessGrace: how long a decline nobody answered is sent again while the consumer may
	// still exist (a clustered consumer between leaders).
	leaderlessGrace = 15 * time.Second
	// goneConfirmed: how long the API must say the consumer is gone before a decline is Stranded.
	goneConfirmed = 5 * time.Second
	// defaultPullBytes: the most bytes one pull asks for (J11).
	defaultPullBytes = 2 << 20
	pullBytesMargin  = 16 << 10
	minPullBatch     = 10
	// awaitOperatorEvery: how often a missing operator consumer is looked for again.
	awaitOperatorEvery = 2 * time.Second
)

// Open binds sub to its consumer and starts pulling.
func (b *Broker) Open(ctx context.Context, sub *messaging.Sub) (messaging.Consumer, error) {
	c := &consumer{broker: b, sub: sub, retired: &atomic.Bool{}, bound: &atomic.Uint64{}}
	if err := c.bind(ctx); err != nil {
		return nil, err
	}
	return c, nil
}

type consumer struct {
	broker  *Broker
	sub     *messaging.Sub
	msgs    jetstream.MessagesContext
	made    time.Time
	retired *atomic.Bool
	// bound counts the bindings to a consumer made again: a delivery remembers its own.
	bound *atomic.Uint64
	// next is the pull's option for the context Next was last called with (one per
	// subscription: made once, not for every message).
	next    jetstream.NextOpt
	nextCtx context.Context
}

// bind finds or makes the consumer and starts pulling from it.
func (c *consumer) bind(ctx context.Context) error {
	b, p := c.broker, c.sub.Policy
	var stream, name string
	var err error
	if p.OwnedByOperator {
		stream, name, err = c.awaitOperator(ctx)
	} else {
		stream, name, err = c.convergeOwn(ctx)
	}
	if err != nil {
		return err
	}
	cons, err := b.js.Consumer(ctx, stream, name)
	if err != nil {
		return fmt.Errorf("nats backend: consumer %s on stream %s: %w", name, stream, err)
	}
	info := cons.CachedInfo()
	if p.OwnedByOperator {
		// The object the operator made this consumer for: the counts from here on are its.
		c.sub.BoundTo(info.Config.Metadata[UIDKey])
		b.boundMu.Lock()
		b.bound[c.sub.Name()] = [2]string{stream, name}
		b.boundMu.Unlock()
	}
	if !c.made.IsZero() && !info.Created.Equal(c.made) {
		c.bound.Add(1)
	}
	c.made = info.Created
	batch := min(max(p.MaxInFlight, minPullBatch), 1000)
	pullBytes := max(defaultPullBytes, int(b.nc.MaxPayload())+pullBytesMargin)
	msgs, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(batch, pullBytes),
		jetstream.PullExpiry(10*time.Second), jetstream.PullHeartbeat(3*time.Second))
	if err != nil {
		return fmt.Errorf("nats backend: cannot pull from stream %s: %w", stream, err)
	}
	c.msgs = msgs
	slog.Info("bound to a JetStream pull consumer", "subscription", c.sub.Name(), "stream", stream, "consumer", name, "operator", p.OwnedByOperator)
	return nil
}

// convergeOwn makes a code-defined subscription's consumer, or brings it to the mapping (the
// server refuses what it cannot change in place, and says which field).
func (c *consumer) convergeOwn(ctx context.Context) (string, string, error) {
	p := c.sub.Policy
	stream, err := resolveStream(ctx, c.broker.js, p.Stream, p.Pattern)
	if err != nil {
		return "", "", fmt.Errorf("nats backend: %w", err)
	}
	want := Desired(c.sub.Namespace, c.sub.Name(), p)
	if _, err := c.broker.js.CreateOrUpdateConsumer(ctx, stream, want); err != nil {
		return "", "", fmt.Errorf("nats backend: consumer %s on stream %s cannot be made or brought to the subscription's policy "+
			"(delete it, or choose another durableName): %w", want.Name, stream, err)
	}
	return stream, want.Name, nil
}

// awaitOperator waits, saying why, until the stream and the operator's consumer exist.
func (c *consumer) awaitOperator(ctx context.Context) (string, string, error) {
	p := c.sub.Policy
	said := ""
	for {
		stream, err := resolveStream(ctx, c.broker.js, p.Stream, p.Pattern)
		name := ConsumerName(c.sub.Namespace, c.sub.Name(), p)
		why := ""
		if err != nil {
			why = err.Error()
		} else if _, err := c.broker.js.Consumer(ctx, stream, name); err == nil {
			return stream, name, nil
		} else if errors.Is(err, jetstream.ErrConsumerNotFound) {
			ns := c.sub.Namespace
			why = fmt.Sprintf("consumer %s on stream %s does not exist yet: the operator creates it from Subscription %s/%s (kubectl describe subscription %s -n %s)",
				name, stream, ns, c.sub.Name(), c.sub.Name(), ns)
		} else {
			why = err.Error()
		}
		if why != said {
			slog.Warn("waiting for the operator's consumer", "subscription", c.sub.Name(), "why", why)
			said = why
		}
		if !messaging.Sleep(ctx, awaitOperatorEvery) {
			return "", "", fmt.Errorf("nats backend: %s", why)
		}
	}
}

func (c *consumer) Next(ctx context.Context) (messaging.Delivery, bool) {
	for {
		if c.msgs == nil {
			return messaging.Delivery{}, false
		}
		if c.nextCtx != ctx {
			c.next, c.nextCtx = jetstream.NextContext(ctx), ctx
		}
		m, err := c.msgs.Next(c.next)
		if err == nil {
			return c.delivery(m), true
		}
		if ctx.Err() != nil || errors.Is(err, jetstream.ErrMsgIteratorClosed) {
			return messaging.Delivery{}, false
		}
		if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, nats.ErrNoResponders) {
			c.msgs.Stop()
			c.msgs = nil
			if c.sub.Policy.OwnedByOperator && !c.retired.Load() {
				// The operator repairs a deleted consumer while its Subscription exists.
				slog.Warn("the operator's consumer is gone; waiting for it to come back", "subscription", c.sub.Name(), "error", err)
				if err := c.bind(ctx); err != nil {
					slog.Error("cannot bind again", "subscription", c.sub.Name(), "error", err)
					return messaging.Delivery{}, false
				}
				continue
			}
			slog.Error("the JetStream consumer is gone", "subscription", c.sub.Name(), "error", err)
			return messaging.Delivery{}, false
		}
		slog.Warn("pulling from JetStream", "subscription", c.sub.Name(), "error", err)
	}
}

func (c *consumer) delivery(m jetstream.Msg) messaging.Delivery {
	// Only the delivery count is read from the ack subject (not the whole metadata).
	attempt := 1
	if _, _, delivered, ok := ackSubject(m.Reply()); ok && delivered > 0 {
		attempt = delivered
	}
	var headers []messaging.Header
	for k, vs := range m.Headers() {
		for _, v := range vs {
			headers = append(headers, messaging.Header{Name: k, Value: v})
		}
	}
	return messaging.NewDelivery(c.sub, messaging.DeliveryOptions{
		Subject: m.Subject(), Headers: headers, Payload: m.Data(), Attempt: attempt,
		OnSettle: &settler{c: c, reply: m.Reply(), offeredIn: c.bound.Load()},
	})
}

func (c *consumer) Stop(context.Context) {
	if c.msgs != nil {
		c.msgs.Stop()
	}
}

func (c *consumer) Retire(context.Context) {
	c.retired.Store(true)
	if c.msgs != nil {
		c.msgs.Stop()
		c.msgs = nil
	}
}

type settler struct {
	c         *consumer
	reply     string
	offeredIn uint64
}

func (s *settler) replyTo() (string, *messaging.Refusal) {
	switch {
	case s.c.retired.Load():
		return "", &messaging.Refusal{Reason: "the consumer that offered this delivery was retired by this process; the server offers the message again after ackWait"}
	case s.c.bound.Load() != s.offeredIn:
		return "", &messaging.Refusal{Reason: "the consumer that offered this delivery was deleted and made again; the new one offers the message afresh"}
	case !s.c.sub.Policy.AtLeastOnce():
		return "", &messaging.Refusal{Reason: "the consumer does not take acknowledgements (ack policy none)"}
	case s.reply == "":
		return "", &messaging.Refusal{Reason: "the message has no reply subject: not a JetStream delivery", Stranded: true}
	}
	return s.reply, nil
}

// The bodies sent with publish, made once.
var (
	ackBody      = []byte("+ACK")
	progressBody = []byte("+WPI")
	releaseBody  = []byte("-NAK")
)

func (s *settler) publish(body []byte) *messaging.Refusal {
	reply, r := s.replyTo()
	if r != nil {
		return r
	}
	if err := s.c.broker.nc.Publish(reply, body); err != nil {
		return &messaging.Refusal{Reason: "cannot send to the server: " + err.Error()}
	}
	return nil
}

// confirmed sends a decline or termination as a request, so the server confirms it.
func (s *settler) confirmed(ctx context.Context, body string) *messaging.Refusal {
	reply, r := s.replyTo()
	if r != nil {
		return r
	}
	stranded := &messaging.Refusal{Reason: "no such consumer on the server any more (deleted?): the message cannot be offered again on it", Stranded: true}
	started := time.Now()
	var goneSince time.Time
	for {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := s.c.broker.nc.RequestWithContext(rctx, reply, []byte(body))
		cancel()
		if err == nil {
			return nil
		}
		if !errors.Is(err, nats.ErrNoResponders) {
			return &messaging.Refusal{Reason: "the server did not confirm: " + err.Error()}
		}
		if time.Since(started) >= leaderlessGrace {
			return stranded
		}
		if s.consumerMayExist(ctx) {
			goneSince = time.Time{}
		} else if goneSince.IsZero() {
			goneSince = time.Now()
		} else if time.Since(goneSince) >= goneConfirmed {
			return stranded
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (s *settler) consumerMayExist(ctx context.Context) bool {
	stream, consumer, _, ok := ackSubject(s.reply)
	if !ok {
		return false
	}
	_, err := s.c.broker.js.Consumer(ctx, stream, consumer)
	return !errors.Is(err, jetstream.ErrConsumerNotFound) && !errors.Is(err, jetstream.ErrStreamNotFound)
}

// ackSubject is the stream, consumer and delivery count of a $JS.ACK reply subject, in either
// of its forms ($JS.ACK.<stream>.<consumer>.<delivered>.… or, with a domain and account hash,
// $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.…).
func ackSubject(reply string) (stream, consumer string, delivered int, ok bool) {
	rest, found := strings.CutPrefix(reply, "$JS.ACK.")
	if !found {
		return "", "", 0, false
	}
	// Read for every delivery: the dots counted at once, then only the tokens wanted cut.
	switch dots := strings.Count(rest, "."); {
	case dots == 6:
	case dots >= 8:
		_, rest, _ = strings.Cut(rest, ".") // the domain
		_, rest, _ = strings.Cut(rest, ".") // the account hash
	default:
		return "", "", 0, false
	}
	stream, rest, _ = strings.Cut(rest, ".")
	consumer, rest, _ = strings.Cut(rest, ".")
	count, _, _ := strings.Cut(rest, ".")
	delivered, _ = strconv.Atoi(count)
	return stream, consumer, delivered, true
}

func nakBody(delay time.Duration) string {
	if delay <= 0 {
		return "-NAK"
	}
	return `-NAK {"delay":` + strconv.FormatInt(delay.Nanoseconds(), 10) + `}`
}

func (s *settler) Settle(ctx context.Context, a messaging.BrokerAction) (messaging.Performed, *messaging.Refusal) {
	var r *messaging.Refusal
	switch a.Kind {
	case messaging.ActAck:
		r = s.publish(ackBody)
	case messaging.ActDecline:
		r = s.confirmed(ctx, nakBody(a.Delay))
	case messaging.ActTerminate:
		r = s.confirmed(ctx, "+TERM")
	}
	return messaging.AsAsked, r
}

func (s *settler) Progress(context.Context) *messaging.Refusal { return s.publish(progressBody) }

func (s *settler) Release(context.Context) {
	if r := s.publish(releaseBody); r != nil {
		slog.Debug("release not sent; the server offers the message again after ackWait", "reason", r.Reason)
	}
}
