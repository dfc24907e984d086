// Package rabbitmq is the RabbitMQ backend of the Go runtime (amqp091-go), the way the Rust
// runtime's `backend::rabbitmq` does it (docs/semantics.md R1–R13): a subscription consumes
// from a quorum queue bound to the Backend's topic exchange by its pattern (the one the Settle
// operator made, whose object mark it reads, or one it declares itself for a code-defined
// subscription), with manual acknowledgement and the prefetch at maxInFlight; the attempt is
// the queue's x-delivery-count plus one; a decline requeues (RabbitMQ cannot delay one), the
// last declined attempt is rejected. Reports go to the instance's own report queue, registered
// in the Subscription's index (docs/stats-report.md "On RabbitMQ"), with user_id set to the
// user it connected as. The operator's pause is followed by its marker exchanges (W3).
//
// Its files, the same roles as every broker's: rabbitmq.go (connect, publish, the report
// sink), consume.go (the queue consumed, each delivery and its settlement, the pause),
// mapping.go (the spec → queue mapping). It must not count anything (the settle path does).
package rabbitmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
)

// DefaultExchange is where queues are bound and messages published unless the Backend names
// another.
const DefaultExchange = "amq.topic"

// confirmTimeout bounds every confirmed publish.
const confirmTimeout = 10 * time.Second

// Broker is RabbitMQ as a backend.
type Broker struct {
	conn       *amqp.Connection
	user       string
	exchange   string
	deadLetter string
	pubMu      sync.Mutex
	pub        *amqp.Channel
	declMu     sync.Mutex
	declared   map[string]bool
	pausePoll  time.Duration
}

// Connect dials RabbitMQ (amqp://user:password@host:port/vhost).
func Connect(url string) (*Broker, error) {
	uri, err := amqp.ParseURI(url)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq backend: %w", err)
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("rabbitmq backend: cannot connect to %s:%d: %w", uri.Host, uri.Port, err)
	}
	return &Broker{conn: conn, user: uri.Username, exchange: DefaultExchange, declared: map[string]bool{}, pausePoll: pausePollInterval()}, nil
}

// WithExchange binds and publishes on another topic exchange (a Backend's `exchange`).
func (b *Broker) WithExchange(name string) *Broker { b.exchange = name; return b }

// WithDeadLetterExchange sets the queues' x-dead-letter-exchange (a Backend's).
func (b *Broker) WithDeadLetterExchange(name string) *Broker { b.deadLetter = name; return b }

// Close closes the connection (after the bus closed).
func (b *Broker) Close() { _ = b.conn.Close() }

func (b *Broker) Kind() string                         { return "rabbitmq" }
func (b *Broker) Capabilities() messaging.Capabilities { return messaging.CapabilitiesOf("rabbitmq") }
func (b *Broker) HandsOnSlowHandlers() bool            { return false }
func (b *Broker) StatsSink() messaging.StatsSink       { return b }

// Publish publishes on the exchange with the subject as routing key, confirmed.
func (b *Broker) Publish(ctx context.Context, subject string, payload []byte, headers []messaging.Header) error {
	b.pubMu.Lock()
	defer b.pubMu.Unlock()
	if b.pub == nil || b.pub.IsClosed() {
		ch, err := b.conn.Channel()
		if err != nil {
			return fmt.Errorf("rabbitmq backend: cannot open a publishing channel: %w", err)
		}
		if err := ch.Confirm(false); err != nil {
			return fmt.Errorf("rabbitmq backend: cannot turn on publisher confirms: %w", err)
		}
		b.pub = ch
	}
	msg := properties(headers)
	msg.Body = payload
	c, err := b.pub.PublishWithDeferredConfirmWithContext(ctx, b.exchange, subject, false, false, msg)
	if err != nil {
		return fmt.Errorf("rabbitmq backend: cannot publish on %q: %w", subject, err)
	}
	wctx, cancel := context.WithTimeout(ctx, confirmTimeout)
	defer cancel()
	ok, err := c.WaitContext(wctx)
	if err != nil {
		return fmt.Errorf("rabbitmq backend: publish on %q not confirmed: %w", subject, err)
	}
	if !ok {
		return fmt.Errorf("rabbitmq backend: the broker refused the message on %q (basic.nack)", subject)
	}
	return nil
}

// properties carries transport headers as AMQP properties: content-type, correlation-id and
// message-id as the properties of those names, the rest in the headers table.
func properties(headers []messaging.Header) amqp.Publishing {
	var p amqp.Publishing
	for _, h := range headers {
		switch strings.ToLower(h.Name) {
		case "content-type":
			p.ContentType = h.Value
		case "correlation-id":
			p.CorrelationId = h.Value
		case "message-id":
			p.MessageId = h.Value
		default:
			if p.Headers == nil {
				p.Headers = amqp.Table{}
			}
			p.Headers[h.Name] = h.Value
		}
	}
	return p
}

// The account's queues (docs/stats-report.md "On RabbitMQ").
const (
	indexMaxLength = 100_000
)

func instanceQueue(ns, sub, instance string) string {
	return "settle.report." + ns + "." + sub + "." + instance
}
func indexQueue(ns, sub string) string  { return "settle.instances." + ns + "." + sub }
func objectQueue(ns, sub string) string { return "settle.object." + ns + "." + sub }

func accountArgs(maxLength int64, overflow string) amqp.Table {
	return amqp.Table{"x-queue-type": "classic", "x-max-length": maxLength, "x-overflow": overflow}
}

var errReturned = errors.New("the queue does not exist (the report came back)")

// publishConfirmed publishes body to queue through the default exchange: persistent JSON,
// mandatory, user_id set, confirmed; on a channel of its own (a refusal closes it).
func (b *Broker) publishConfirmed(ctx context.Context, queue string, body []byte) error {
	ch, err := b.conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
		ContentType: "application/json", DeliveryMode: amqp.Persistent, UserId: b.user, Body: body,
	})
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, confirmTimeout)
	defer cancel()
	ok, err := c.WaitContext(wctx)
	if err != nil {
		return fmt.Errorf("no confirm for the publish to %q: %w", queue, err)
	}
	select {
	case <-returns: // RabbitMQ returns an unroutable mandatory message before it confirms it
		return errReturned
	default:
	}
	if !ok {
		return fmt.Errorf("the broker refused the publish to %q (basic.nack: full?)", queue)
	}
	return nil
}

// register declares an instance's report queue and registers it in its Subscription's index,
// once (before its first report, and again after the queue was found gone).
func (b *Broker) register(ctx context.Context, ns, sub, queue string) error {
	b.declMu.Lock()
	done := b.declared[queue]
	b.declMu.Unlock()
	if done {
		return nil
	}
	ch, err := b.conn.Channel()
	if err != nil {
		return err
	}
	_, err = ch.QueueDeclare(queue, true, false, false, false, accountArgs(1, "drop-head"))
	if err == nil {
		_, err = ch.QueueDeclare(indexQueue(ns, sub), true, false, false, false, accountArgs(indexMaxLength, "reject-publish"))
	}
	_ = ch.Close()
	if err != nil {
		return fmt.Errorf("cannot declare the report queue %q: %w", queue, err)
	}
	reg, _ := json.Marshal(map[string]string{"queue": queue})
	if err := b.publishConfirmed(ctx, indexQueue(ns, sub), reg); err != nil {
		return fmt.Errorf("cannot register the report queue %q in %q: %w", queue, indexQueue(ns, sub), err)
	}
	b.declMu.Lock()
	b.declared[queue] = true
	b.declMu.Unlock()
	return nil
}

// Put publishes one report to its instance's own report queue (the key is not used: the
// report names its Subscription and instance). A report that comes back (its queue gone) is
// an error; the queue is declared and registered again at the next report.
func (b *Broker) Put(ctx context.Context, _ string, body []byte) error {
	var owner struct{ Namespace, Subscription, Instance string }
	if err := json.Unmarshal(body, &owner); err != nil {
		return fmt.Errorf("rabbitmq backend: a stats report without its Subscription: %w", err)
	}
	queue := instanceQueue(owner.Namespace, owner.Subscription, owner.Instance)
	if err := b.register(ctx, owner.Namespace, owner.Subscription, queue); err != nil {
		return fmt.Errorf("rabbitmq backend: %w", err)
	}
	if err := b.publishConfirmed(ctx, queue, body); err != nil {
		if errors.Is(err, errReturned) {
			b.declMu.Lock()
			delete(b.declared, queue)
			b.declMu.Unlock()
		}
		return fmt.Errorf("rabbitmq backend: a report to %q did not land: %w", queue, err)
	}
	return nil
}

// readObject reads the object mark of Subscription ns/sub (settle.object.<ns>.<sub>, one
// message, taken and put back): "" when there is none. A reader that finds the queue empty
// reads again for up to 2 s: another reader was holding the message.
func (b *Broker) readObject(ns, sub string) string {
	ch, err := b.conn.Channel()
	if err != nil {
		return ""
	}
	defer ch.Close()
	deadline := time.Now().Add(2 * time.Second)
	for {
		m, ok, err := ch.Get(objectQueue(ns, sub), false)
		if err != nil {
			return ""
		}
		if !ok {
			if time.Now().After(deadline) {
				return ""
			}
			time.Sleep(50 * time.Millisecond)
			continue
		}
		var mark struct {
			UID string `json:"uid"`
		}
		_ = json.Unmarshal(m.Body, &mark)
		_ = m.Reject(true)
		return mark.UID
	}
}

// ReadMark reads the object mark of the operator's queue sub consumes from, now.
func (b *Broker) ReadMark(_ context.Context, sub *messaging.Sub) string {
	if !sub.Policy.OwnedByOperator {
		return ""
	}
	return b.readObject(sub.Namespace, sub.Name())
}
