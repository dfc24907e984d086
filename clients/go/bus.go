package messaging

// The bus: subscriptions on a backend (each subscription's loop, its lease and its close are
// dispatch.go's), the graceful stop of them all, and the stats report loop. It must not talk
// to a broker except through the Backend seam.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"
)

// DefaultCloseGrace is how long Close waits for running handlers before releasing their attempts.
const DefaultCloseGrace = 30 * time.Second

// lastReportTries is how often the last report is tried at Close.
const lastReportTries = 5

// Options configure a Bus; the zero value takes every default.
type Options struct {
	// Namespace of the Subscriptions (POD_NAMESPACE, else default).
	Namespace string
	// Instance names this process in reports (DefaultInstance()).
	Instance string
	// CloseGrace: DefaultCloseGrace unless set.
	CloseGrace time.Duration
	// ReportInterval: DefaultReportInterval unless set.
	ReportInterval time.Duration
	// NoReports turns the stats report off.
	NoReports bool
}

// Bus errors.
var (
	ErrClosed = errors.New("the bus is closed")
)

// RefusedError is a subscription the backend cannot honour (the rules' findings).
type RefusedError struct {
	Name, Backend string
	Verdict       Verdict
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("subscription %q cannot run on the %s backend: %s", e.Name, e.Backend, e.Verdict.ErrorText())
}

type running struct {
	stop context.CancelFunc
	done chan struct{}
}

// Bus runs handlers on a backend and keeps their account.
type Bus struct {
	backend   Backend
	opts      Options
	startedAt uint64
	mu        sync.Mutex
	closed    bool
	subs      map[string]*Sub
	running   map[string]*running
	reportsOn bool
	stopRep   context.CancelFunc
	repDone   chan struct{}
}

// New makes a bus on backend.
func New(backend Backend, opts Options) *Bus {
	if opts.Namespace == "" {
		opts.Namespace = DefaultNamespace()
	}
	if opts.Instance == "" {
		opts.Instance = DefaultInstance()
	}
	if opts.CloseGrace == 0 {
		opts.CloseGrace = DefaultCloseGrace
	}
	if opts.ReportInterval == 0 {
		opts.ReportInterval = DefaultReportInterval
	}
	return &Bus{backend: backend, opts: opts, startedAt: nowMs(), subs: map[string]*Sub{}, running: map[string]*running{}}
}

// Instance is who this process is in reports.
func (b *Bus) Instance() string { return b.opts.Instance }

// Capabilities is the backend's.
func (b *Bus) Capabilities() Capabilities { return b.backend.Capabilities() }

// Subscribe checks a spec against the backend (refusing, with every finding, what it cannot
// honour), binds it to its consumer and starts running its handler.
func (b *Bus) Subscribe(ctx context.Context, spec SubscriptionSpec) error {
	v := Validate(spec, b.backend.Capabilities())
	if len(v.Errors) > 0 {
		return &RefusedError{Name: spec.Name, Backend: b.backend.Kind(), Verdict: v}
	}
	for _, w := range v.Warnings {
		slog.Warn(w.String(), "subscription", spec.Name)
	}
	if spec.Handler == nil {
		return fmt.Errorf("subscription %q has no Handler: set SubscriptionSpec.Handler", spec.Name)
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return ErrClosed
	}
	if _, dup := b.running[spec.Name]; dup {
		b.mu.Unlock()
		return fmt.Errorf("a subscription named %q is already running on this bus", spec.Name)
	}
	sub := b.subs[spec.Name]
	if sub == nil {
		sub = NewSub(spec.Resolve(), b.opts.Namespace, b.startedAt)
		b.subs[spec.Name] = sub
	}
	r := &running{done: make(chan struct{})}
	b.running[spec.Name] = r
	b.mu.Unlock()

	consumer, err := b.backend.Open(ctx, sub)
	if err != nil {
		b.mu.Lock()
		delete(b.running, spec.Name)
		b.mu.Unlock()
		return err
	}
	loopCtx, stop := context.WithCancel(context.Background())
	r.stop = stop
	var lease *leaseTimes
	p := sub.Policy
	if b.backend.HandsOnSlowHandlers() && p.AtLeastOnce() && p.SlowHandler == ExtendLease {
		lease = &leaseTimes{ackWait: p.AckWait, maxProcessing: p.MaxProcessingTime}
	}
	go func() {
		defer close(r.done)
		dispatch(loopCtx, sub, spec.Handler, consumer, b.opts.CloseGrace, lease)
	}()
	b.startReports()
	slog.Info("subscribed", "subscription", spec.Name, "backend", b.backend.Kind())
	return nil
}

// Publish publishes a message.
func (b *Bus) Publish(ctx context.Context, subject string, payload []byte, headers ...Header) error {
	return b.backend.Publish(ctx, subject, payload, headers)
}

// Stats is the cumulative account of subscription name in this process.
func (b *Bus) Stats(name string) (ConsumerStats, bool) {
	b.mu.Lock()
	s := b.subs[name]
	b.mu.Unlock()
	if s == nil {
		return ConsumerStats{}, false
	}
	st, _ := s.Stats()
	return st, true
}

// RuntimeStats is subscription name's handler errors and panics.
func (b *Bus) RuntimeStats(name string) (RuntimeStats, bool) {
	b.mu.Lock()
	s := b.subs[name]
	b.mu.Unlock()
	if s == nil {
		return RuntimeStats{}, false
	}
	_, rt := s.Stats()
	return rt, true
}

// Unsubscribe stops one subscription: no new attempt is taken, running handlers get the close
// grace, then their attempts are released. Its counters stay.
func (b *Bus) Unsubscribe(name string) error {
	b.mu.Lock()
	r := b.running[name]
	delete(b.running, name)
	b.mu.Unlock()
	if r == nil {
		return fmt.Errorf("no subscription named %q on this bus", name)
	}
	r.stop()
	<-r.done
	return nil
}

// Close is the graceful stop: every subscription stops (see Unsubscribe), then a last stats
// report is published and confirmed (a few tries). Call it when the process is asked to stop
// (StopSignal), so the final counts reach the operator.
func (b *Bus) Close() {
	b.mu.Lock()
	b.closed = true
	all := b.running
	b.running = map[string]*running{}
	stopRep, repDone := b.stopRep, b.repDone
	b.mu.Unlock()
	var wg sync.WaitGroup
	for _, r := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.stop()
			<-r.done
		}()
	}
	wg.Wait()
	if stopRep != nil {
		stopRep()
		<-repDone
	}
}

// StopSignal is a context that ends when the process is asked to stop: SIGTERM (what
// Kubernetes sends a pod) or SIGINT. Close the bus then.
func StopSignal() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

func (b *Bus) subsNow() []*Sub {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]*Sub, 0, len(b.subs))
	for _, s := range b.subs {
		out = append(out, s)
	}
	return out
}

func (b *Bus) startReports() {
	b.mu.Lock()
	defer b.mu.Unlock()
	sink := b.backend.StatsSink()
	if b.reportsOn || b.opts.NoReports || sink == nil {
		return
	}
	b.reportsOn = true
	ctx, stop := context.WithCancel(context.Background())
	b.stopRep, b.repDone = stop, make(chan struct{})
	r := &reporter{namespace: b.opts.Namespace, instance: b.opts.Instance, backend: b.backend.Kind(), sink: sink, last: map[string]*lastReport{}}
	go func() {
		defer close(b.repDone)
		tick := time.NewTicker(b.opts.ReportInterval)
		defer tick.Stop()
		marksRead := time.Now()
		for {
			select {
			case <-ctx.Done():
				// The last report: tried until the broker confirms it, a few times.
				for attempt := 1; attempt <= lastReportTries; attempt++ {
					c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					ok := r.tick(c, b.subsNow(), attempt == 1)
					cancel()
					if ok {
						return
					}
					time.Sleep(250 * time.Millisecond)
				}
				slog.Error("the last stats report was not confirmed: the operator keeps the counts of the report before it (at most one report interval behind)")
				return
			case <-tick.C:
			}
			subs := b.subsNow()
			if time.Since(marksRead) >= MarkRecheck {
				marksRead = time.Now()
				for _, s := range subs {
					if s.BoundUID() == "" {
						continue
					}
					if uid := b.backend.ReadMark(ctx, s); uid != "" {
						s.BoundTo(uid)
					}
				}
			}
			c, cancel := context.WithTimeout(ctx, 10*time.Second)
			r.tick(c, subs, false)
			cancel()
		}
	}()
}
