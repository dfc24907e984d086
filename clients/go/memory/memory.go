// Package memory is the in-memory backend: the embedded default for tests and local
// development. It holds every published message in process, delivers it to each matching
// subscription (fanout), redelivers declined messages after their delay, and keeps durable
// consumers for as long as the Broker lives (so a bus restarted on the same Broker resumes
// where it left off). It never hands a message on while a handler runs (docs/semantics.md H4).
// It must not count anything: counting is the settle path's job.
package memory

import (
	"container/heap"
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	messaging "settle.dev/messaging"
)

// Broker is the in-memory backend.
type Broker struct {
	mu        sync.Mutex
	log       []stored
	consumers map[string]*consumerState
	reports   map[string][]byte
	ids       uint64
}

type stored struct {
	subject string
	headers []messaging.Header
	payload []byte
}

// New is an empty in-memory broker.
func New() *Broker {
	return &Broker{consumers: map[string]*consumerState{}, reports: map[string][]byte{}}
}

// Reports is the stats reports published to it, by key.
func (b *Broker) Reports() map[string][]byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[string][]byte, len(b.reports))
	for k, v := range b.reports {
		out[k] = v
	}
	return out
}

// Pending is how many messages of a durable consumer wait to be offered (ready or delayed).
func (b *Broker) Pending(durable string) int {
	b.mu.Lock()
	cs := b.consumers[durable]
	b.mu.Unlock()
	if cs == nil {
		return 0
	}
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return len(cs.ready) + len(cs.delayed)
}

func (b *Broker) id() uint64 {
	b.ids++
	return b.ids
}

// SubjectMatches says whether subject matches the NATS-style pattern (`*` one token, `>` one
// or more at the end).
func SubjectMatches(pattern, subject string) bool {
	p, s := strings.Split(pattern, "."), strings.Split(subject, ".")
	for i := 0; ; i++ {
		switch {
		case i == len(p) && i == len(s):
			return true
		case i == len(p) || i == len(s):
			return false
		case p[i] == ">":
			return true
		case p[i] == "*" || p[i] == s[i]:
		default:
			return false
		}
	}
}

func (b *Broker) Kind() string                                    { return "memory" }
func (b *Broker) Capabilities() messaging.Capabilities            { return messaging.CapabilitiesOf("memory") }
func (b *Broker) HandsOnSlowHandlers() bool                       { return false }
func (b *Broker) StatsSink() messaging.StatsSink                  { return b }
func (b *Broker) ReadMark(context.Context, *messaging.Sub) string { return "" }

// Put stores a stats report.
func (b *Broker) Put(_ context.Context, key string, body []byte) error {
	b.mu.Lock()
	b.reports[key] = append([]byte(nil), body...)
	b.mu.Unlock()
	return nil
}

// Publish stores a message and makes it ready for every matching consumer.
func (b *Broker) Publish(_ context.Context, subject string, payload []byte, headers []messaging.Header) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	seq := len(b.log)
	b.log = append(b.log, stored{subject, headers, append([]byte(nil), payload...)})
	for _, cs := range b.consumers {
		if SubjectMatches(cs.pattern, subject) {
			cs.mu.Lock()
			cs.ready[seq] = 0
			cs.mu.Unlock()
			cs.wake()
		}
	}
	return nil
}

// Open binds a subscription to its durable consumer (made on first use; an AtMostOnce one
// without a durable name is ephemeral and starts now).
func (b *Broker) Open(_ context.Context, sub *messaging.Sub) (messaging.Consumer, error) {
	p := sub.Policy
	b.mu.Lock()
	defer b.mu.Unlock()
	attachment := b.id()
	key := p.DurableName
	if key == "" {
		key = fmt.Sprintf("_ephemeral-%d", attachment)
	}
	cs := b.consumers[key]
	if cs != nil && cs.pattern != p.Pattern {
		return nil, fmt.Errorf("memory backend: durable consumer %q exists with pattern %q, not %q: use another durableName", key, cs.pattern, p.Pattern)
	}
	if cs == nil {
		cs = &consumerState{pattern: p.Pattern, acks: p.AtLeastOnce(), ready: map[int]int{},
			inFlight: map[uint64]inFlight{}, live: map[uint64]bool{}, signal: make(chan struct{})}
		if p.DurableName != "" {
			for seq, m := range b.log {
				if SubjectMatches(p.Pattern, m.subject) {
					cs.ready[seq] = 0
				}
			}
		}
		b.consumers[key] = cs
	}
	cs.mu.Lock()
	cs.live[attachment] = true
	cs.mu.Unlock()
	return &consumer{broker: b, sub: sub, cs: cs, attachment: attachment}, nil
}

type pending struct{ seq, attempts int }

type inFlight struct {
	attachment uint64
	p          pending
}

type delayed struct {
	at time.Time
	p  pending
}

type delayHeap []delayed

func (h delayHeap) Len() int { return len(h) }
func (h delayHeap) Less(i, j int) bool {
	if h[i].at.Equal(h[j].at) {
		return h[i].p.seq < h[j].p.seq
	}
	return h[i].at.Before(h[j].at)
}
func (h delayHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *delayHeap) Push(x any)   { *h = append(*h, x.(delayed)) }
func (h *delayHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type consumerState struct {
	pattern  string
	acks     bool
	mu       sync.Mutex
	ready    map[int]int // seq → attempts spent
	delayed  delayHeap
	inFlight map[uint64]inFlight
	live     map[uint64]bool
	signal   chan struct{} // closed and replaced to wake every waiter
}

func (cs *consumerState) wake() {
	cs.mu.Lock()
	close(cs.signal)
	cs.signal = make(chan struct{})
	cs.mu.Unlock()
}

func (cs *consumerState) putBack(p pending, delay time.Duration) {
	if delay > 0 {
		heap.Push(&cs.delayed, delayed{time.Now().Add(delay), p})
	} else {
		cs.ready[p.seq] = p.attempts
	}
}

type consumer struct {
	broker     *Broker
	sub        *messaging.Sub
	cs         *consumerState
	attachment uint64
	retired    bool
}

// take is one step: a delivery ready now, or how long to wait, or retired.
func (c *consumer) take() (p pending, token uint64, wait <-chan struct{}, until time.Time, ok, retired bool) {
	cs := c.cs
	c.broker.mu.Lock()
	token = c.broker.id()
	c.broker.mu.Unlock()
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if c.retired || !cs.live[c.attachment] {
		return p, 0, nil, until, false, true
	}
	now := time.Now()
	for cs.delayed.Len() > 0 && !cs.delayed[0].at.After(now) {
		d := heap.Pop(&cs.delayed).(delayed)
		cs.ready[d.p.seq] = d.p.attempts
	}
	if len(cs.ready) > 0 {
		seqs := make([]int, 0, len(cs.ready))
		for s := range cs.ready {
			seqs = append(seqs, s)
		}
		sort.Ints(seqs)
		p = pending{seq: seqs[0], attempts: cs.ready[seqs[0]] + 1}
		delete(cs.ready, seqs[0])
		if cs.acks {
			cs.inFlight[token] = inFlight{c.attachment, p}
		}
		return p, token, nil, until, true, false
	}
	if cs.delayed.Len() > 0 {
		until = cs.delayed[0].at
	}
	return p, 0, cs.signal, until, false, false
}

func (c *consumer) Next(ctx context.Context) (messaging.Delivery, bool) {
	for {
		p, token, wait, until, ok, retired := c.take()
		if retired {
			return messaging.Delivery{}, false
		}
		if ok {
			return c.delivery(p, token), true
		}
		var timer <-chan time.Time
		if !until.IsZero() {
			t := time.NewTimer(time.Until(until))
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-ctx.Done():
			return messaging.Delivery{}, false
		case <-wait:
		case <-timer:
		}
	}
}

func (c *consumer) delivery(p pending, token uint64) messaging.Delivery {
	c.broker.mu.Lock()
	m := c.broker.log[p.seq]
	c.broker.mu.Unlock()
	return messaging.NewDelivery(c.sub, messaging.DeliveryOptions{
		Subject: m.subject, Headers: m.headers, Payload: m.payload, Attempt: p.attempts,
		OnSettle: &settler{cs: c.cs, token: token},
	})
}

func (c *consumer) Stop(context.Context) {}

// Retire ends this attachment: its unsettled messages go back, ready at once, attempts kept.
func (c *consumer) Retire(context.Context) {
	c.retired = true
	cs := c.cs
	cs.mu.Lock()
	delete(cs.live, c.attachment)
	for t, f := range cs.inFlight {
		if f.attachment == c.attachment {
			delete(cs.inFlight, t)
			cs.putBack(f.p, 0)
		}
	}
	cs.mu.Unlock()
	cs.wake()
}

type settler struct {
	cs    *consumerState
	token uint64
}

func (s *settler) requeue(delay time.Duration) bool {
	s.cs.mu.Lock()
	f, ok := s.cs.inFlight[s.token]
	if ok {
		delete(s.cs.inFlight, s.token)
		s.cs.putBack(f.p, delay)
	}
	s.cs.mu.Unlock()
	if ok {
		s.cs.wake()
	}
	return ok
}

func (s *settler) Settle(_ context.Context, a messaging.BrokerAction) (messaging.Performed, *messaging.Refusal) {
	var done bool
	if a.Kind == messaging.ActDecline {
		done = s.requeue(a.Delay)
	} else {
		s.cs.mu.Lock()
		_, done = s.cs.inFlight[s.token]
		delete(s.cs.inFlight, s.token)
		s.cs.mu.Unlock()
	}
	if !done {
		return messaging.AsAsked, &messaging.Refusal{Reason: "the consumer that offered this delivery was retired; the message is offered again to the next consumer"}
	}
	return messaging.AsAsked, nil
}

func (s *settler) Progress(context.Context) *messaging.Refusal { return nil }
func (s *settler) Release(context.Context)                     { s.requeue(0) }
