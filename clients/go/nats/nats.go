// Package nats is the NATS JetStream backend of the Go runtime: it binds a subscription to a
// pull consumer on the stream whose subjects cover its pattern (the one the Settle operator
// made, or one it makes itself for a code-defined subscription), turns each JetStream message
// into a Delivery, settles with JetStream's ack protocol (docs/semantics.md J1–J7), and writes
// the stats report to the `settle-stats` key-value bucket (docs/stats-report.md), the same way
// the Rust runtime does.
//
// Its files, the same roles as every broker's: nats.go (connect, publish, the report sink),
// consume.go (the consumer bound to, each delivery and its settlement), mapping.go (the spec →
// consumer mapping). It must not count anything (the settle path does) nor create streams.
package nats

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
)

// The report bucket (docs/stats-report.md): name, and its limits when this runtime makes it.
const (
	ReportBucket              = "settle-stats"
	ReportBucketMaxValueBytes = 65_536
	ReportBucketMaxBytes      = 1 << 30
	// InboxPrefixEnv overrides the inbox prefix (else _INBOX.<namespace>).
	InboxPrefixEnv = "SETTLE_NATS_INBOX_PREFIX"
)

// Broker is NATS JetStream as a backend.
type Broker struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	bucket string
	kvMu   sync.Mutex
	kv     jetstream.KeyValue
	// The operator's consumer each subscription is bound to (stream, consumer), by name.
	boundMu sync.Mutex
	bound   map[string][2]string
}

// Connect connects to a NATS server (or a comma-separated list of a cluster's servers) as an
// application of namespace: its inbox prefix is SETTLE_NATS_INBOX_PREFIX's, else
// _INBOX.<namespace>, so a shared account can grant each tenant its own inboxes only. A user
// and password in the URL are given to the client.
func Connect(servers, namespace string) (*Broker, error) {
	prefix := os.Getenv(InboxPrefixEnv)
	if prefix == "" {
		prefix = "_INBOX." + namespace
	} else if !validPrefix(prefix) {
		return nil, fmt.Errorf("nats backend: %s=%q is not an inbox prefix: give subject tokens separated by "+
			"single dots, without wildcards or spaces (for example `_INBOX.team-a`)", InboxPrefixEnv, prefix)
	}
	opts := []nats.Option{nats.CustomInboxPrefix(prefix), nats.MaxReconnects(-1), nats.Name("settle-go")}
	var urls []string
	for _, s := range strings.Split(servers, ",") {
		u, err := url.Parse(strings.TrimSpace(s))
		if err == nil && u.User != nil {
			pw, _ := u.User.Password()
			opts = append(opts, nats.UserInfo(u.User.Username(), pw))
			u.User = nil
			s = u.String()
		}
		urls = append(urls, strings.TrimSpace(s))
	}
	nc, err := nats.Connect(strings.Join(urls, ","), opts...)
	if err != nil {
		return nil, fmt.Errorf("nats backend: cannot connect to %s: %w", strings.Join(urls, ","), err)
	}
	return FromConn(nc)
}

func validPrefix(p string) bool {
	for _, t := range strings.Split(p, ".") {
		if t == "" || strings.ContainsAny(t, "*> \t\r\n") {
			return false
		}
	}
	return true
}

// FromConn uses an existing connection.
func FromConn(nc *nats.Conn) (*Broker, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("nats backend: %w", err)
	}
	return &Broker{nc: nc, js: js, bucket: ReportBucket, bound: map[string][2]string{}}, nil
}

// WithStatsBucket sends reports to another bucket (tests).
func (b *Broker) WithStatsBucket(name string) *Broker {
	b.bucket = name
	return b
}

// Conn is the connection.
func (b *Broker) Conn() *nats.Conn { return b.nc }

// JetStream is the JetStream context.
func (b *Broker) JetStream() jetstream.JetStream { return b.js }

// Close closes the connection (after the bus closed).
func (b *Broker) Close() { b.nc.Close() }

func (b *Broker) Kind() string                         { return "nats" }
func (b *Broker) Capabilities() messaging.Capabilities { return messaging.CapabilitiesOf("nats") }
func (b *Broker) HandsOnSlowHandlers() bool            { return true }
func (b *Broker) StatsSink() messaging.StatsSink       { return b }

// Publish publishes with JetStream's publish acknowledgement.
func (b *Broker) Publish(ctx context.Context, subject string, payload []byte, headers []messaging.Header) error {
	m := nats.NewMsg(subject)
	m.Data = payload
	for _, h := range headers {
		m.Header.Add(h.Name, h.Value)
	}
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		return fmt.Errorf("nats backend: publishing to %s: %w", subject, err)
	}
	return nil
}

// statsBucket is the report bucket, made if missing (history 1, file storage).
func (b *Broker) statsBucket(ctx context.Context) (jetstream.KeyValue, error) {
	b.kvMu.Lock()
	defer b.kvMu.Unlock()
	if b.kv != nil {
		return b.kv, nil
	}
	kv, err := b.js.KeyValue(ctx, b.bucket)
	if err != nil {
		kv, err = b.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
			Bucket:       b.bucket,
			Description:  "Settle runtime stats reports: <namespace>.<subscription>.<instance> -> JSON (docs/stats-report.md)",
			History:      1,
			MaxValueSize: ReportBucketMaxValueBytes,
			MaxBytes:     ReportBucketMaxBytes,
		})
		if err != nil {
			// Another instance may have made it meanwhile.
			if kv2, err2 := b.js.KeyValue(ctx, b.bucket); err2 == nil {
				kv, err = kv2, nil
			} else {
				return nil, fmt.Errorf("nats backend: cannot create KV bucket %s: %w", b.bucket, err)
			}
		}
	}
	b.kv = kv
	return kv, nil
}

// Put writes one report under its key.
func (b *Broker) Put(ctx context.Context, key string, body []byte) error {
	kv, err := b.statsBucket(ctx)
	if err != nil {
		return err
	}
	if _, err := kv.Put(ctx, key, body); err != nil {
		if errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, jetstream.ErrNoStreamResponse) {
			b.kvMu.Lock()
			b.kv = nil // made again at the next report
			b.kvMu.Unlock()
		}
		return fmt.Errorf("nats backend: report %s: %w", key, err)
	}
	return nil
}

// ReadMark reads the UID mark of the operator's consumer sub is bound to, now.
func (b *Broker) ReadMark(ctx context.Context, sub *messaging.Sub) string {
	b.boundMu.Lock()
	sc, ok := b.bound[sub.Name()]
	b.boundMu.Unlock()
	if !ok {
		return ""
	}
	c, err := b.js.Consumer(ctx, sc[0], sc[1])
	if err != nil {
		return ""
	}
	return c.CachedInfo().Config.Metadata[UIDKey]
}
