package rabbitmq

// Consuming from RabbitMQ: the queue a subscription consumes from (declared from the mapping
// for a code-defined subscription; waited for when the operator makes it, its object mark read
// before anything is taken), each delivery, its settlement (basic.ack; basic.nack with requeue
// for a decline; basic.reject without requeue for the last declined attempt, after the
// runtime counted it Exhausted), and the operator's pause (W3): while the marker exchange
// settle.paused.<queue> is there the consumer is cancelled, and at the resume the mark is read
// again before consuming (a Subscription deleted and applied again while paused has a new
// queue under the same name). Every broker call of the close waits at most closeStep. It must
// not count anything.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
)

const (
	closeStep          = 5 * time.Second
	awaitOperatorEvery = time.Second
	maxPrefetch        = 65535
)

// pausePollInterval is SETTLE_PAUSE_POLL_INTERVAL (5s unless set, at least 100ms).
func pausePollInterval() time.Duration {
	d, err := time.ParseDuration(os.Getenv("SETTLE_PAUSE_POLL_INTERVAL"))
	if err != nil || d == 0 {
		return 5 * time.Second
	}
	return max(d, 100*time.Millisecond)
}

var tags atomic.Uint64

type consumer struct {
	b        *Broker
	sub      *messaging.Sub
	queue    string
	mu       sync.Mutex
	ch       *amqp.Channel
	tag      string
	in       <-chan amqp.Delivery
	retired  *atomic.Bool
	paused   atomic.Bool
	stopPoll context.CancelFunc
}

// Open binds sub to its queue and starts consuming.
func (b *Broker) Open(ctx context.Context, sub *messaging.Sub) (messaging.Consumer, error) {
	p := sub.Policy
	c := &consumer{b: b, sub: sub, queue: QueueName(sub.Namespace, sub.Name(), p), retired: &atomic.Bool{}}
	if p.OwnedByOperator {
		if err := c.awaitOperator(ctx); err != nil {
			return nil, err
		}
		sub.BoundTo(b.readObject(sub.Namespace, sub.Name()))
	} else if err := c.declare(); err != nil {
		return nil, err
	}
	if err := c.consume(); err != nil {
		return nil, err
	}
	if p.OwnedByOperator {
		pctx, stop := context.WithCancel(context.Background())
		c.stopPoll = stop
		go c.watchPause(pctx)
	}
	slog.Info("consuming from a RabbitMQ queue", "subscription", sub.Name(), "queue", c.queue, "exchange", b.exchange, "operator", p.OwnedByOperator)
	return c, nil
}

// declare makes a code-defined subscription's queue (RabbitMQ refuses, 406, a queue of that
// name with other arguments) and binds it by the pattern.
func (c *consumer) declare() error {
	p := c.sub.Policy
	ch, err := c.b.conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq backend: %w", err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(c.queue, true, false, false, false, arguments(c.sub.Namespace, c.sub.Name(), p, c.b.deadLetter, true)); err != nil {
		return fmt.Errorf("rabbitmq backend: queue %q cannot be declared as the subscription's policy asks (delete it, or choose another durableName): %w", c.queue, err)
	}
	if err := ch.QueueBind(c.queue, RoutingKey(p.Pattern), c.b.exchange, false, nil); err != nil {
		return fmt.Errorf("rabbitmq backend: cannot bind queue %q to %q: %w", c.queue, c.b.exchange, err)
	}
	return nil
}

// awaitOperator waits, saying why, until the operator's queue exists.
func (c *consumer) awaitOperator(ctx context.Context) error {
	said := false
	for {
		ch, err := c.b.conn.Channel()
		if err != nil {
			return fmt.Errorf("rabbitmq backend: %w", err)
		}
		_, err = ch.QueueDeclarePassive(c.queue, true, false, false, false, nil)
		_ = ch.Close()
		if err == nil {
			return nil
		}
		if !said {
			ns := c.sub.Namespace
			slog.Info("waiting for the operator's queue", "subscription", c.sub.Name(), "reason",
				fmt.Sprintf("queue %s does not exist yet: the operator creates it from Subscription %s/%s (kubectl describe subscription %s -n %s)", c.queue, ns, c.sub.Name(), c.sub.Name(), ns))
			said = true
		}
		if !messaging.Sleep(ctx, awaitOperatorEvery) {
			return fmt.Errorf("rabbitmq backend: queue %s does not exist", c.queue)
		}
	}
}

// consume opens a channel and consumes the queue on it.
func (c *consumer) consume() error {
	p := c.sub.Policy
	ch, err := c.b.conn.Channel()
	if err != nil {
		return fmt.Errorf("rabbitmq backend: cannot open a channel: %w", err)
	}
	if p.AtLeastOnce() {
		if err := ch.Qos(min(p.MaxInFlight, maxPrefetch), 0, false); err != nil {
			return fmt.Errorf("rabbitmq backend: basic.qos: %w", err)
		}
	}
	tag := fmt.Sprintf("settle-%s-%d-%d", c.sub.Name(), os.Getpid(), tags.Add(1))
	in, err := ch.Consume(c.queue, tag, !p.AtLeastOnce(), false, false, false, nil)
	if err != nil {
		_ = ch.Close()
		return fmt.Errorf("rabbitmq backend: cannot consume from queue %q: %w", c.queue, err)
	}
	c.mu.Lock()
	c.ch, c.tag, c.in = ch, tag, in
	c.mu.Unlock()
	return nil
}

func (c *consumer) Next(ctx context.Context) (messaging.Delivery, bool) {
	for {
		c.mu.Lock()
		in := c.in
		c.mu.Unlock()
		select {
		case <-ctx.Done():
			return messaging.Delivery{}, false
		case d, ok := <-in:
			if ok {
				return c.delivery(d), true
			}
		}
		// The stream ended: a pause cancelled it, the queue went, or the channel closed.
		if c.retired.Load() || ctx.Err() != nil {
			return messaging.Delivery{}, false
		}
		if !c.sub.Policy.OwnedByOperator {
			slog.Error("the queue is gone or the channel closed", "subscription", c.sub.Name(), "queue", c.queue)
			return messaging.Delivery{}, false
		}
		for c.paused.Load() {
			if !messaging.Sleep(ctx, c.b.pausePoll/2) {
				return messaging.Delivery{}, false
			}
		}
		// The operator repairs a deleted queue while its Subscription exists; one made again
		// for a new object is learnt from its mark before anything is taken (C15).
		if err := c.awaitOperator(ctx); err != nil {
			return messaging.Delivery{}, false
		}
		c.sub.BoundTo(c.b.readObject(c.sub.Namespace, c.sub.Name()))
		if err := c.consume(); err != nil {
			slog.Warn("cannot consume again; trying again in 1s", "subscription", c.sub.Name(), "error", err)
			if !messaging.Sleep(ctx, time.Second) {
				return messaging.Delivery{}, false
			}
		}
	}
}

// attempt is the quorum queue's x-delivery-count plus one; without it, 2 when redelivered.
func attempt(d amqp.Delivery) int {
	if v, ok := d.Headers["x-delivery-count"]; ok {
		if n, err := strconv.Atoi(fmt.Sprint(v)); err == nil {
			return n + 1
		}
	}
	if d.Redelivered {
		return 2
	}
	return 1
}

func (c *consumer) delivery(d amqp.Delivery) messaging.Delivery {
	var headers []messaging.Header
	for _, h := range []struct{ name, value string }{{"content-type", d.ContentType}, {"correlation-id", d.CorrelationId}, {"message-id", d.MessageId}} {
		if h.value != "" {
			headers = append(headers, messaging.Header{Name: h.name, Value: h.value})
		}
	}
	for k, v := range d.Headers {
		headers = append(headers, messaging.Header{Name: k, Value: fmt.Sprint(v)})
	}
	return messaging.NewDelivery(c.sub, messaging.DeliveryOptions{
		Subject: d.RoutingKey, Headers: headers, Payload: d.Body, Attempt: attempt(d),
		OnSettle: &settler{d: d, retired: c.retired, acks: c.sub.Policy.AtLeastOnce()},
	})
}

// watchPause checks the operator's pause markers every poll interval; paused, it cancels the
// consumer (what was sent already is still handed out), and Next consumes again at the resume.
func (c *consumer) watchPause(ctx context.Context) {
	for {
		if !messaging.Sleep(ctx, c.b.pausePoll) {
			return
		}
		paused, err := c.b.isPaused(c.queue, c.paused.Load())
		if err != nil || paused == c.paused.Load() {
			continue
		}
		c.paused.Store(paused)
		if paused {
			slog.Info("paused: fetching stopped until the Subscription is resumed (deliveries already taken finish)", "subscription", c.sub.Name())
			c.mu.Lock()
			ch, tag := c.ch, c.tag
			c.mu.Unlock()
			if ch != nil {
				_ = ch.Cancel(tag, false)
			}
		} else {
			slog.Info("resumed: consuming again", "subscription", c.sub.Name(), "queue", c.queue)
		}
	}
}

// exchangeExists looks an exchange up with a passive declare, on a channel of its own (a
// missing one closes it).
func (b *Broker) exchangeExists(name string) (bool, error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return false, err
	}
	err = ch.ExchangeDeclarePassive(name, "fanout", true, false, true, false, nil)
	if err == nil {
		_ = ch.Close()
		return true, nil
	}
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return false, nil
	}
	return false, err
}

// isPaused reads the operator's markers as the Rust runtime does: once paused, paused while
// settle.paused.<queue> is there; else running while settle.running.<queue> is there, and
// paused only when the paused marker is.
func (b *Broker) isPaused(queue string, was bool) (bool, error) {
	if was {
		return b.exchangeExists("settle.paused." + queue)
	}
	running, err := b.exchangeExists("settle.running." + queue)
	if err != nil || running {
		return false, err
	}
	return b.exchangeExists("settle.paused." + queue)
}

// within runs f, waiting at most closeStep: the close goes on whatever the broker does.
func within(f func() error) {
	done := make(chan struct{})
	go func() { _ = f(); close(done) }()
	select {
	case <-done:
	case <-time.After(closeStep):
	}
}

func (c *consumer) Stop(context.Context) {
	if c.stopPoll != nil {
		c.stopPoll()
	}
	c.mu.Lock()
	ch, tag := c.ch, c.tag
	c.mu.Unlock()
	if ch != nil {
		within(func() error { return ch.Cancel(tag, false) })
	}
}

// Retire closes the channel: the broker requeues every unsettled delivery on it (R5).
func (c *consumer) Retire(context.Context) {
	c.retired.Store(true)
	c.mu.Lock()
	ch := c.ch
	c.mu.Unlock()
	if ch != nil {
		within(ch.Close)
	}
}

type settler struct {
	d       amqp.Delivery
	retired *atomic.Bool
	acks    bool
}

func (s *settler) check() *messaging.Refusal {
	if s.retired.Load() {
		return &messaging.Refusal{Reason: "the consumer that offered this delivery was retired and its channel closed; the broker requeued the message"}
	}
	if !s.acks {
		return &messaging.Refusal{Reason: "the consumer takes no acknowledgements (automatic acknowledgement)"}
	}
	return nil
}

func done(what string, err error) *messaging.Refusal {
	if err == nil {
		return nil
	}
	return &messaging.Refusal{Reason: fmt.Sprintf("%s failed: %v (the broker requeues the message when the channel closes)", what, err)}
}

func (s *settler) Settle(_ context.Context, a messaging.BrokerAction) (messaging.Performed, *messaging.Refusal) {
	if r := s.check(); r != nil {
		return messaging.AsAsked, r
	}
	switch a.Kind {
	case messaging.ActAck:
		return messaging.AsAsked, done("basic.ack", s.d.Ack(false))
	case messaging.ActDecline:
		if r := done("basic.nack", s.d.Nack(false, true)); r != nil {
			return messaging.AsAsked, r
		}
		if a.Delay > 0 {
			return messaging.DelayShortened, nil // RabbitMQ cannot delay a requeue (admission refuses schedules here)
		}
		return messaging.AsAsked, nil
	default:
		return messaging.AsAsked, done("basic.reject", s.d.Reject(false))
	}
}

func (s *settler) Progress(context.Context) *messaging.Refusal { return nil }

func (s *settler) Release(context.Context) {
	if s.check() == nil {
		within(func() error { return s.d.Nack(false, true) })
	}
}
