// Package sqs is the SQS backend of the Go runtime (aws-sdk-go-v2), the way the Rust
// runtime's `backend::sqs` does it (docs/semantics.md Q1–Q11): a subscription receives from
// its own queue `<prefix><durableName>` (the one the Settle operator made, whose settle-object
// tag names the object it counts for, or one it makes itself for a code-defined subscription,
// with its dead-letter queue), long-polled for at most the free slots; the attempt is
// ApproximateReceiveCount; an ack deletes, a decline sets the visibility to its delay (whole
// seconds, within twelve hours of the first receive, else DelayShortened), ExtendLease sets it
// to ackWait again. Reports go to the report queue the operator makes beside the queue
// (`<queue>-settle-stats.fifo`, the instance as message group). The operator's pause is its
// settle-paused tag (W4).
//
// Its files, the same roles as every broker's: sqs.go (connect, publish, the report sink),
// consume.go (the queue received from, each delivery and its settlement, the pause),
// mapping.go (the spec → queue mapping, and how long SQS may hold a message). It must not count
// anything (the settle path does).
package sqs

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	messaging "settle.dev/messaging"
)

// Settings say where SQS is and who calls it.
type Settings struct {
	// Region (e.g. eu-west-1); AWS_REGION unless set.
	Region string
	// Endpoint, for an SQS-compatible server (ElasticMQ); SQS's own unless set.
	Endpoint string
	// Static keys; AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY unless set.
	AccessKeyID, SecretAccessKey string
	// QueuePrefix is put before every queue name (a Backend's queuePrefix).
	QueuePrefix string
}

// bodyEncoding is the message attribute that says a body is base64.
const bodyEncoding = "settle-body-encoding"

// Broker is SQS as a backend.
type Broker struct {
	client *awssqs.Client
	prefix string
	mu     sync.Mutex
	urls   map[string]string
	// Where each subscription reports: the report queue beside the operator's queue ("" for a
	// code-defined subscription: no operator reads it).
	reports map[string]string
	// The URL of the operator's queue each subscription is bound to, where its mark is read.
	bound     map[string]string
	longPoll  int32
	pausePoll int32
}

// Connect makes an SQS client.
func Connect(s Settings) (*Broker, error) {
	if s.Region == "" {
		s.Region = os.Getenv("AWS_REGION")
	}
	if s.AccessKeyID == "" {
		s.AccessKeyID, s.SecretAccessKey = os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY")
	}
	if s.Region == "" || s.AccessKeyID == "" {
		return nil, errors.New("sqs backend: set Settings.Region and the keys (or AWS_REGION, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
	}
	opts := awssqs.Options{
		Region:      s.Region,
		Credentials: credentials.NewStaticCredentialsProvider(s.AccessKeyID, s.SecretAccessKey, ""),
	}
	if s.Endpoint != "" {
		opts.BaseEndpoint = aws.String(s.Endpoint)
	}
	return &Broker{client: awssqs.New(opts), prefix: s.QueuePrefix, urls: map[string]string{},
		reports: map[string]string{}, bound: map[string]string{}, longPoll: 20, pausePoll: pauseSeconds()}, nil
}

// WithLongPoll sets how long a receive waits for messages (20 s unless set; at least 1).
func (b *Broker) WithLongPoll(seconds int32) *Broker { b.longPoll = max(seconds, 1); return b }

// Client is the SQS client.
func (b *Broker) Client() *awssqs.Client { return b.client }

func (b *Broker) Kind() string                         { return "sqs" }
func (b *Broker) Capabilities() messaging.Capabilities { return messaging.CapabilitiesOf("sqs") }
func (b *Broker) HandsOnSlowHandlers() bool            { return true }
func (b *Broker) StatsSink() messaging.StatsSink       { return b }

// queueURL is the URL of queue name ("" when there is none).
func (b *Broker) queueURL(ctx context.Context, name string) (string, error) {
	b.mu.Lock()
	u, ok := b.urls[name]
	b.mu.Unlock()
	if ok {
		return u, nil
	}
	out, err := b.client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
	if err != nil {
		var missing *types.QueueDoesNotExist
		if errors.As(err, &missing) || strings.Contains(err.Error(), "NonExistentQueue") {
			return "", nil
		}
		return "", fmt.Errorf("sqs backend: GetQueueUrl %s: %w", name, err)
	}
	b.mu.Lock()
	b.urls[name] = aws.ToString(out.QueueUrl)
	b.mu.Unlock()
	return aws.ToString(out.QueueUrl), nil
}

func (b *Broker) forgetURL(name string) {
	b.mu.Lock()
	delete(b.urls, name)
	b.mu.Unlock()
}

func queueMissing(err error) bool {
	var missing *types.QueueDoesNotExist
	return errors.As(err, &missing) || strings.Contains(err.Error(), "NonExistentQueue") || strings.Contains(err.Error(), "QueueDoesNotExist")
}

// Publish sends to the queue `<prefix><subject>` (a subject is a queue's name); a payload
// that is not text SQS can carry goes base64, marked by the settle-body-encoding attribute.
func (b *Broker) Publish(ctx context.Context, subject string, payload []byte, headers []messaging.Header) error {
	name := b.prefix + subject
	url, err := b.queueURL(ctx, name)
	if err != nil {
		return err
	}
	if url == "" {
		return fmt.Errorf("sqs backend: no SQS queue named %q (a subject is a queue's name)", name)
	}
	body, encoded := string(payload), !sqsText(payload)
	if encoded {
		body = base64.StdEncoding.EncodeToString(payload)
		headers = append(headers, messaging.Header{Name: bodyEncoding, Value: "base64"})
	}
	attrs := map[string]types.MessageAttributeValue{}
	for _, h := range headers {
		attrs[h.Name] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(h.Value)}
	}
	in := &awssqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(body)}
	if len(attrs) > 0 {
		in.MessageAttributes = attrs
	}
	if _, err := b.client.SendMessage(ctx, in); err != nil {
		if queueMissing(err) {
			b.forgetURL(name)
		}
		return fmt.Errorf("sqs backend: SendMessage to %s: %w", name, err)
	}
	return nil
}

// sqsText says whether SQS carries p as a message body: valid UTF-8 of #x9, #xA, #xD and
// #x20 to #xFFFD (and beyond #x10000), nothing else.
func sqsText(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	for _, r := range string(p) {
		ok := r == 0x9 || r == 0xA || r == 0xD || (r >= 0x20 && r <= 0xD7FF) || (r >= 0xE000 && r <= 0xFFFD) || r >= 0x10000
		if !ok {
			return false
		}
	}
	return true
}

// Put sends one report to the Subscription's report queue, the instance as its message group.
func (b *Broker) Put(ctx context.Context, _ string, body []byte) error {
	var owner struct{ Subscription, Instance string }
	if err := json.Unmarshal(body, &owner); err != nil {
		return fmt.Errorf("sqs backend: a stats report without its Subscription: %w", err)
	}
	b.mu.Lock()
	queue, known := b.reports[owner.Subscription]
	b.mu.Unlock()
	switch {
	case !known:
		return fmt.Errorf("sqs backend: subscription %q is not bound to the operator's queue yet: its report waits", owner.Subscription)
	case queue == "":
		return nil // a code-defined subscription: no operator reads its reports
	}
	url, err := b.queueURL(ctx, queue)
	if err != nil {
		return err
	}
	if url == "" {
		return fmt.Errorf("sqs backend: no SQS queue named %q (the report queue: the operator makes it beside the Subscription's queue; the report is sent again at the next interval)", queue)
	}
	_, err = b.client.SendMessage(ctx, &awssqs.SendMessageInput{QueueUrl: aws.String(url), MessageBody: aws.String(string(body)), MessageGroupId: aws.String(groupOf(owner.Instance))})
	if err != nil {
		if queueMissing(err) {
			b.forgetURL(queue)
		}
		return fmt.Errorf("sqs backend: SendMessage to %s: %w", queue, err)
	}
	return nil
}

// groupOf is an instance's message group: its name when SQS takes it, else a hash of it.
func groupOf(instance string) string {
	fits := instance != "" && len(instance) <= 128
	for _, c := range instance {
		if c <= ' ' || c > '~' {
			fits = false
		}
	}
	if fits {
		return instance
	}
	return fmt.Sprintf("instance-%016x", fnv(instance))
}

func fnv(s string) uint64 {
	h := uint64(0xcbf29ce484222325)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint64(s[i])) * 0x100000001b3
	}
	return h
}

// tags are a queue's tags.
func (b *Broker) tags(ctx context.Context, url string) (map[string]string, error) {
	out, err := b.client.ListQueueTags(ctx, &awssqs.ListQueueTagsInput{QueueUrl: aws.String(url)})
	if err != nil {
		return nil, err
	}
	return out.Tags, nil
}

// ReadMark reads the settle-object tag of the operator's queue sub is bound to, now.
func (b *Broker) ReadMark(ctx context.Context, sub *messaging.Sub) string {
	b.mu.Lock()
	url := b.bound[sub.Name()]
	b.mu.Unlock()
	if url == "" {
		return ""
	}
	t, err := b.tags(ctx, url)
	if err != nil {
		return ""
	}
	return t[objectTag]
}

func sortedHeaders(m map[string]types.MessageAttributeValue) []messaging.Header {
	var hs []messaging.Header
	for k, v := range m {
		if v.StringValue != nil {
			hs = append(hs, messaging.Header{Name: k, Value: *v.StringValue})
		}
	}
	sort.Slice(hs, func(i, j int) bool { return hs[i].Name < hs[j].Name })
	return hs
}

func decodeBase64(b []byte) ([]byte, error) { return base64.StdEncoding.DecodeString(string(b)) }
