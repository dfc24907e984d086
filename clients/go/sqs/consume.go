package sqs

// Receiving from SQS: the queue a subscription receives from (made from the mapping with its
// dead-letter queue for a code-defined subscription; waited for when the operator makes it,
// its settle-object tag read before anything is received, and again after it was found missing
// or the subscription resumed: a queue made again for a new object keeps the old URL), each
// delivery, and its settlement (Q3): DeleteMessage for an ack, the visibility set to the delay
// for a decline, visible at once for the last declined attempt where a redrive takes it to the
// dead-letter queue (else deleted), deleted as handed out under AtMostOnce. The operator's
// pause is the queue's settle-paused tag (W4). It must not count anything.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	messaging "settle.dev/messaging"
)

// maxReceive is the most messages one ReceiveMessage returns (SQS's limit).
const maxReceive = 10

// pauseSeconds is SETTLE_PAUSE_POLL_INTERVAL in whole seconds (5 unless set, at least 1).
func pauseSeconds() int32 {
	d, err := time.ParseDuration(os.Getenv("SETTLE_PAUSE_POLL_INTERVAL"))
	if err != nil || d <= 0 {
		return 5
	}
	return int32(max(ceilSecs(d), 1))
}

type consumer struct {
	b        *Broker
	sub      *messaging.Sub
	url      string
	redrives bool
	retired  atomic.Bool
	mu       sync.Mutex
	buffered []types.Message
	missing  bool // the queue was found missing, or the subscription resumed: read the mark first
}

// Open binds sub to its queue.
func (b *Broker) Open(ctx context.Context, sub *messaging.Sub) (messaging.Consumer, error) {
	p := sub.Policy
	want, err := desired(b.prefix, p)
	if err != nil {
		return nil, fmt.Errorf("sqs backend: %w", err)
	}
	c := &consumer{b: b, sub: sub, redrives: want.dlq != ""}
	if p.OwnedByOperator {
		if c.url, err = c.awaitOperator(ctx, want.name); err != nil {
			return nil, err
		}
		if t, err := b.tags(ctx, c.url); err == nil {
			sub.BoundTo(t[objectTag])
		}
		b.mu.Lock()
		b.bound[sub.Name()] = c.url
		b.reports[sub.Name()] = reportQueue(want.name)
		b.mu.Unlock()
	} else {
		if c.url, err = b.convergeOwn(ctx, want); err != nil {
			return nil, err
		}
		b.mu.Lock()
		b.reports[sub.Name()] = ""
		b.mu.Unlock()
	}
	slog.Info("bound to an SQS queue", "subscription", sub.Name(), "queue", c.url, "operator", p.OwnedByOperator)
	return c, nil
}

func (b *Broker) createQueue(ctx context.Context, name string, attrs map[string]string) (string, error) {
	out, err := b.client.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name), Attributes: attrs})
	if err != nil {
		return "", fmt.Errorf("sqs backend: CreateQueue %s: %w", name, err)
	}
	b.mu.Lock()
	b.urls[name] = aws.ToString(out.QueueUrl)
	b.mu.Unlock()
	return aws.ToString(out.QueueUrl), nil
}

// convergeOwn makes a code-defined subscription's queue (and dead-letter queue), or brings
// their attributes to the mapping.
func (b *Broker) convergeOwn(ctx context.Context, want queueSpec) (string, error) {
	attrs := map[string]string{"VisibilityTimeout": strconv.Itoa(int(want.visibility))}
	if want.dlq != "" {
		dlq, err := b.queueURL(ctx, want.dlq)
		if err != nil {
			return "", err
		}
		if dlq == "" {
			if dlq, err = b.createQueue(ctx, want.dlq, map[string]string{"MessageRetentionPeriod": strconv.Itoa(dlqRetention)}); err != nil {
				return "", err
			}
		}
		got, err := b.client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: aws.String(dlq), AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn}})
		if err != nil {
			return "", fmt.Errorf("sqs backend: GetQueueAttributes %s: %w", want.dlq, err)
		}
		attrs["RedrivePolicy"] = redrivePolicy(got.Attributes["QueueArn"], want.maxReceive)
	}
	url, err := b.queueURL(ctx, want.name)
	if err != nil {
		return "", err
	}
	if url == "" {
		return b.createQueue(ctx, want.name, attrs)
	}
	if _, err := b.client.SetQueueAttributes(ctx, &awssqs.SetQueueAttributesInput{QueueUrl: aws.String(url), Attributes: attrs}); err != nil {
		return "", fmt.Errorf("sqs backend: SetQueueAttributes %s: %w", want.name, err)
	}
	return url, nil
}

// awaitOperator waits, saying why, until the operator's queue exists.
func (c *consumer) awaitOperator(ctx context.Context, name string) (string, error) {
	said := false
	for {
		url, err := c.b.queueURL(ctx, name)
		if err == nil && url != "" {
			return url, nil
		}
		if !said {
			ns := c.sub.Namespace
			slog.Info("waiting for the operator's queue", "subscription", c.sub.Name(), "reason",
				fmt.Sprintf("no SQS queue named %q yet: the operator creates it from Subscription %s/%s (kubectl describe subscription %s -n %s)", name, ns, c.sub.Name(), c.sub.Name(), ns))
			said = true
		}
		if !messaging.Sleep(ctx, time.Second) {
			return "", fmt.Errorf("sqs backend: no SQS queue named %q", name)
		}
	}
}

// Next hands out the next received message, receiving when none is buffered: as many as the
// subscription has free slots (MaxInFlight minus the attempts the bus holds), up to SQS's ten,
// so a received message is taken at once and no lease runs on one waiting (P1, as the Rust
// runtime receives).
func (c *consumer) Next(ctx context.Context) (messaging.Delivery, bool) {
	backoff := 200 * time.Millisecond
	for {
		if ctx.Err() != nil || c.retired.Load() {
			return messaging.Delivery{}, false
		}
		c.mu.Lock()
		if len(c.buffered) > 0 {
			m := c.buffered[0]
			c.buffered = c.buffered[1:]
			c.mu.Unlock()
			if d, ok := c.delivery(ctx, m); ok {
				return d, true
			}
			continue
		}
		c.mu.Unlock()
		if c.sub.Policy.OwnedByOperator {
			paused, err := c.paused(ctx)
			if err == nil && paused {
				c.missing = true // the queue may be made again meanwhile (W4)
				if !messaging.Sleep(ctx, time.Duration(c.b.pausePoll)*time.Second) {
					return messaging.Delivery{}, false
				}
				continue
			}
			if c.missing {
				t, err := c.b.tags(ctx, c.url)
				if err != nil {
					if !messaging.Sleep(ctx, backoff) {
						return messaging.Delivery{}, false
					}
					backoff = min(backoff*2, 5*time.Second)
					continue
				}
				c.sub.BoundTo(t[objectTag])
				c.missing = false
			}
		}
		wait := c.b.longPoll
		if c.sub.Policy.OwnedByOperator {
			wait = max(min(wait, c.b.pausePoll), 1)
		}
		out, err := c.b.client.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{
			QueueUrl: aws.String(c.url), MaxNumberOfMessages: c.batch(ctx), WaitTimeSeconds: wait,
			VisibilityTimeout: visibilitySecs(c.sub.Policy.AckWait),
			MessageSystemAttributeNames: []types.MessageSystemAttributeName{
				types.MessageSystemAttributeNameApproximateReceiveCount, types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp},
			MessageAttributeNames: []string{"All"},
		})
		if err != nil {
			if ctx.Err() != nil {
				return messaging.Delivery{}, false
			}
			c.missing = c.missing || queueMissing(err)
			slog.Warn("receiving from SQS; trying again", "subscription", c.sub.Name(), "error", err, "in", backoff)
			if !messaging.Sleep(ctx, backoff) {
				return messaging.Delivery{}, false
			}
			backoff = min(backoff*2, 5*time.Second)
			continue
		}
		backoff = 200 * time.Millisecond
		c.mu.Lock()
		c.buffered = append(c.buffered, out.Messages...)
		c.mu.Unlock()
	}
}

func (c *consumer) paused(ctx context.Context) (bool, error) {
	t, err := c.b.tags(ctx, c.url)
	if err != nil {
		return false, err
	}
	v, ok := t[pauseTag]
	if !ok {
		return false, nil
	}
	until, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return true, nil // `indefinite`, or anything but a time: paused
	}
	return until.After(time.Now()), nil
}

func (c *consumer) delivery(ctx context.Context, m types.Message) (messaging.Delivery, bool) {
	if m.ReceiptHandle == nil {
		return messaging.Delivery{}, false
	}
	num := func(n types.MessageSystemAttributeName) int64 {
		v, _ := strconv.ParseInt(m.Attributes[string(n)], 10, 64)
		return v
	}
	attempt := int(num(types.MessageSystemAttributeNameApproximateReceiveCount))
	first := num(types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp)
	if first == 0 {
		first = time.Now().UnixMilli()
	}
	headers := sortedHeaders(m.MessageAttributes)
	body := []byte(aws.ToString(m.Body))
	for i, h := range headers {
		if h.Name == bodyEncoding && h.Value == "base64" {
			headers = append(headers[:i], headers[i+1:]...)
			if raw, err := decodeBase64(body); err == nil {
				body = raw
			}
			break
		}
	}
	if !c.sub.Policy.AtLeastOnce() {
		if _, err := c.b.client.DeleteMessage(ctx, &awssqs.DeleteMessageInput{QueueUrl: aws.String(c.url), ReceiptHandle: m.ReceiptHandle}); err != nil {
			slog.Warn("could not delete a message handed out under AtMostOnce: SQS offers it again after ackWait", "subscription", c.sub.Name(), "error", err)
		}
	}
	return messaging.NewDelivery(c.sub, messaging.DeliveryOptions{
		Subject: c.sub.Policy.Pattern, Headers: headers, Payload: body, Attempt: attempt,
		OnSettle: &settler{c: c, receipt: aws.ToString(m.ReceiptHandle), first: first},
	}), true
}

// batch is how many messages a receive asks for: the free slots, 1 to 10.
//
// Under load every slot is held, and each one freed would be refilled by a receive of one, a
// round trip a message: a receive that would ask for fewer than ten waits, up to gatherFor,
// for more handlers to end (they started together and end close together).
func (c *consumer) batch(ctx context.Context) int32 {
	limit := max(c.sub.Policy.MaxInFlight, 1)
	want := min(limit, maxReceive)
	free := limit - c.sub.Running()
	if free < want {
		timer := time.NewTimer(gatherFor)
		defer timer.Stop()
	gather:
		for free < want {
			select {
			case <-c.sub.Freed():
				free = limit - c.sub.Running()
			case <-timer.C:
				break gather
			case <-ctx.Done():
				break gather
			}
		}
	}
	return int32(min(max(free, 1), maxReceive))
}

// gatherFor is the longest a receive waits for more free slots (batch).
const gatherFor = 20 * time.Millisecond

// giveBack makes what was received and not handed out visible again at once.
func (c *consumer) giveBack() {
	c.mu.Lock()
	left := c.buffered
	c.buffered = nil
	c.mu.Unlock()
	for _, m := range left {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _ = c.b.client.ChangeMessageVisibility(ctx, &awssqs.ChangeMessageVisibilityInput{QueueUrl: aws.String(c.url), ReceiptHandle: m.ReceiptHandle, VisibilityTimeout: 0})
		cancel()
	}
}

// SettlementWaits: every settlement is an HTTP call (messaging.SettlementWaits).
func (c *consumer) SettlementWaits() bool { return true }

func (c *consumer) Stop(context.Context)   { c.giveBack() }
func (c *consumer) Retire(context.Context) { c.retired.Store(true); c.giveBack() }

type settler struct {
	c       *consumer
	receipt string
	first   int64
}

func (s *settler) visibility(ctx context.Context, secs int32) error {
	_, err := s.c.b.client.ChangeMessageVisibility(ctx, &awssqs.ChangeMessageVisibilityInput{QueueUrl: aws.String(s.c.url), ReceiptHandle: aws.String(s.receipt), VisibilityTimeout: secs})
	return err
}

func (s *settler) Settle(ctx context.Context, a messaging.BrokerAction) (messaging.Performed, *messaging.Refusal) {
	if s.c.retired.Load() {
		return messaging.AsAsked, &messaging.Refusal{Reason: "the consumer that offered this delivery was retired by this process; SQS offers the message again after ackWait"}
	}
	var err error
	performed := messaging.AsAsked
	switch {
	case a.Kind == messaging.ActAck || (a.Kind == messaging.ActTerminate && !s.c.redrives):
		_, err = s.c.b.client.DeleteMessage(ctx, &awssqs.DeleteMessageInput{QueueUrl: aws.String(s.c.url), ReceiptHandle: aws.String(s.receipt)})
	case a.Kind == messaging.ActTerminate:
		err = s.visibility(ctx, 0) // the next receive finds it past maxReceiveCount: the redrive takes it
	default:
		secs, shortened := hold(s.first, time.Now().UnixMilli(), a.Delay, HoldLimit)
		if err = s.visibility(ctx, secs); err == nil && shortened {
			performed = messaging.DelayShortened
		}
	}
	if err != nil {
		return messaging.AsAsked, &messaging.Refusal{Reason: err.Error()}
	}
	return performed, nil
}

func (s *settler) Progress(ctx context.Context) *messaging.Refusal {
	if s.c.retired.Load() {
		return &messaging.Refusal{Reason: "the consumer was retired"}
	}
	secs, _ := hold(s.first, time.Now().UnixMilli(), s.c.sub.Policy.AckWait, HoldLimit)
	if secs == 0 {
		return &messaging.Refusal{Reason: fmt.Sprintf("the message has been held %s since its first receive, SQS's limit: the lease cannot be extended", HoldLimit)}
	}
	if err := s.visibility(ctx, secs); err != nil {
		return &messaging.Refusal{Reason: err.Error()}
	}
	return nil
}

func (s *settler) Release(context.Context) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.visibility(ctx, 0)
}
