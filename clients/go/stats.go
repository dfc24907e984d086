package messaging

// The counters (docs/semantics.md C1–C13) and the epochs they are reported in (C15): one
// subscription's live counts, shared by its deliveries. It must not talk to a broker.

import (
	"sync"
	"sync/atomic"
)

// Settlement is how attempts were settled (C5, C6).
type Settlement struct {
	Acked   uint64 `json:"acked"`
	Nacked  uint64 `json:"nacked"`
	Silent  uint64 `json:"silent"`
	Refused uint64 `json:"refused"`
}

// ConsumerStats is one subscription's account, field for field the Subscription's
// status.stats and the stats report's "stats" (docs/stats-report.md).
type ConsumerStats struct {
	Offered          uint64     `json:"offered"`
	Delivered        uint64     `json:"delivered"`
	Released         uint64     `json:"released"`
	Lost             uint64     `json:"lost"`
	Settlement       Settlement `json:"settlement"`
	Exhausted        uint64     `json:"exhausted"`
	Stranded         uint64     `json:"stranded"`
	LeaseExpired     uint64     `json:"leaseExpired"`
	DelayShortened   uint64     `json:"delayShortened"`
	ForeignConflicts uint64     `json:"foreignConflicts"`
}

// RuntimeStats is what the runtime counts beside ConsumerStats (C13).
type RuntimeStats struct {
	HandlerErrors uint64 `json:"handlerErrors"`
	Panics        uint64 `json:"panics"`
}

// counter names one counter.
type counter int

const (
	cOffered counter = iota
	cDelivered
	cReleased
	cLost
	cAcked
	cNacked
	cSilent
	cRefused
	cExhausted
	cStranded
	cLeaseExpired
	cDelayShortened
	cForeignConflicts
	cHandlerErrors
	cPanics
	nCounters
)

type counters [nCounters]atomic.Uint64

func (c *counters) snapshot() (ConsumerStats, RuntimeStats) {
	g := func(k counter) uint64 { return c[k].Load() }
	return ConsumerStats{
			Offered: g(cOffered), Delivered: g(cDelivered), Released: g(cReleased), Lost: g(cLost),
			Settlement: Settlement{Acked: g(cAcked), Nacked: g(cNacked), Silent: g(cSilent), Refused: g(cRefused)},
			Exhausted:  g(cExhausted), Stranded: g(cStranded), LeaseExpired: g(cLeaseExpired),
			DelayShortened: g(cDelayShortened), ForeignConflicts: g(cForeignConflicts),
		}, RuntimeStats{
			HandlerErrors: g(cHandlerErrors), Panics: g(cPanics),
		}
}

// epoch is the stretch of a subscription's counts that belongs to one Subscription object:
// what the counters held when it began, and what deliveries of earlier epochs counted since,
// are left out of its reports (C15: a delivery belongs to the count it was offered in).
type epoch struct {
	uid        string
	startedAt  uint64
	generation uint64
	baseline   [nCounters]uint64
	earlier    [nCounters]uint64
}

// Sub is one subscription as the runtime and its backend share it: its policy and counters.
// A backend receives it when it opens a consumer and passes it to every NewDelivery.
type Sub struct {
	Policy    Policy
	Namespace string
	// running is the attempts the bus holds now: taken, their handler not yet returned;
	// freed is signalled (never blocking) each time one ends.
	running atomic.Int64
	freed   chan struct{}
	counts  counters
	mu      sync.RWMutex
	epoch   epoch
}

// NewSub is a subscription context counting from startedAtMs (Unix ms).
func NewSub(p Policy, namespace string, startedAtMs uint64) *Sub {
	return &Sub{Policy: p, Namespace: namespace, epoch: epoch{startedAt: startedAtMs}, freed: make(chan struct{}, 1)}
}

// Running is how many attempts the bus holds now (taken from the consumer, their handler not
// yet returned): a backend that receives several messages at a time receives no more than
// MaxInFlight minus these, so nothing waits received and untaken while its lease runs.
func (s *Sub) Running() int { return int(s.running.Load()) }

// Freed is signalled when an attempt the bus held ends (at most one signal waits: read
// Running again after it).
func (s *Sub) Freed() <-chan struct{} { return s.freed }

func (s *Sub) started() { s.running.Add(1) }

func (s *Sub) ended() {
	s.running.Add(-1)
	select {
	case s.freed <- struct{}{}:
	default:
	}
}

// Name is the subscription's name.
func (s *Sub) Name() string { return s.Policy.Name }

// count counts one event of a delivery offered in epoch generation gen.
func (s *Sub) count(gen uint64, k counter) {
	s.mu.RLock()
	if gen == s.epoch.generation {
		s.counts[k].Add(1)
		s.mu.RUnlock()
		return
	}
	s.mu.RUnlock()
	s.mu.Lock()
	s.counts[k].Add(1)
	if gen != s.epoch.generation {
		s.epoch.earlier[k]++
	}
	s.mu.Unlock()
}

// offer counts an attempt Offered (and a ForeignConflict) in the current epoch; returns it.
func (s *Sub) offer(foreign bool) uint64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	s.counts[cOffered].Add(1)
	if foreign {
		s.counts[cForeignConflicts].Add(1)
	}
	return s.epoch.generation
}

// BoundTo says the backend bound the subscription to a consumer the operator marked as
// Subscription object uid's. Another object than before starts a new count for it (C15).
func (s *Sub) BoundTo(uid string) {
	if uid == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.epoch.uid {
	case uid:
		return
	case "":
		// The first object this subscription learns of: the counts so far are its.
		s.epoch.uid = uid
		return
	}
	e := epoch{uid: uid, startedAt: nowMs(), generation: s.epoch.generation + 1}
	for k := range s.counts {
		e.baseline[k] = s.counts[k].Load()
	}
	if e.startedAt <= s.epoch.startedAt {
		e.startedAt = s.epoch.startedAt + 1
	}
	s.epoch = e
}

// BoundUID is the object the counts now belong to ("" when unknown).
func (s *Sub) BoundUID() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.epoch.uid
}

// Stats is the process's cumulative account of this subscription.
func (s *Sub) Stats() (ConsumerStats, RuntimeStats) { return s.counts.snapshot() }

// epochStats is what a report carries: the current object's counts only.
func (s *Sub) epochStats() (uid string, startedAt uint64, st ConsumerStats, rt RuntimeStats) {
	s.mu.RLock()
	var now counters
	for k := range s.counts {
		now[k].Store(s.counts[k].Load() - s.epoch.baseline[k] - s.epoch.earlier[k])
	}
	uid, startedAt = s.epoch.uid, s.epoch.startedAt
	s.mu.RUnlock()
	st, rt = now.snapshot()
	return
}
