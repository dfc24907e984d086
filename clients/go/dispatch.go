package messaging

// One subscription's loop: a delivery is taken only with one of MaxInFlight slots free, so no
// more than MaxInFlight attempts are held (P1); its handler runs on the goroutine that took it,
// which hands taking on to another when the handler is slow (for a consumer whose settlements
// wait for the broker, SettlementWaits, every handler runs on a goroutine of its own at once).
// The lease kept for slow handlers (H1, H2) is a timer, started only for a handler past the
// handoff, not a goroutine. The close: running handlers get the grace, then their attempts are
// released.
// It must not talk to a broker except through the Consumer and the delivery's OnSettle.

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

type leaseTimes struct{ ackWait, maxProcessing time.Duration }

// handOff is how long a handler runs inline, on the goroutine that took its delivery, before
// another goroutine takes over taking deliveries: a handler that answers at once costs no
// goroutine switch (the Rust runtime polls a handler once inline for the same reason), and a
// slow one holds up the next delivery by one to two of these (the watcher's ticks).
const handOff = 500 * time.Microsecond

// pump is one subscription's loop: one goroutine at a time takes deliveries and runs each
// handler itself; a watcher hands taking on to a new goroutine when a handler runs past
// handOff. The watcher looks every handOff while a handler runs inline, and sleeps otherwise;
// it alone reads the clock, so a delivery costs two atomic stores, not a timer or a clock
// read.
type pump struct {
	sub     *Sub
	h       Handler
	c       Consumer
	lease   *leaseTimes
	ctx     context.Context // the subscription's: ends at close
	hctx    context.Context // the handlers': ends when their attempts are given up
	free    chan int        // free slots (MaxInFlight of them): a delivery holds one
	current []atomic.Pointer[state]
	busy    sync.WaitGroup // deliveries taken and not finished
	takers  sync.WaitGroup // goroutines taking deliveries (one, but for a moment at a handoff)
	// inline is the run (a number) whose handler runs inline now, 0 when none;
	// inlineDelivery its delivery. Whoever swaps inline to 0 first decides: the taker goes
	// on, or the watcher hands taking on (and starts the run's lease keeper).
	inline         atomic.Uint64
	inlineDelivery atomic.Pointer[state]
	runs           uint64
	asleep         atomic.Bool
	wake           chan struct{}
	// apart: every handler runs on a goroutine of its own at once (SettlementWaits).
	apart bool
}

// dispatch is one subscription's loop, until ctx ends or the consumer does; then the close:
// the consumer stops fetching, running handlers get the grace, what is left is released.
func dispatch(ctx context.Context, sub *Sub, h Handler, c Consumer, grace time.Duration, lease *leaseTimes) {
	limit := max(sub.Policy.MaxInFlight, 1)
	hctx, cancelHandlers := context.WithCancel(context.Background())
	defer cancelHandlers()
	p := &pump{sub: sub, h: h, c: c, lease: lease, ctx: ctx, hctx: hctx,
		free: make(chan int, limit), current: make([]atomic.Pointer[state], limit), wake: make(chan struct{}, 1)}
	if w, ok := c.(SettlementWaits); ok {
		p.apart = w.SettlementWaits()
	}
	for i := range limit {
		p.free <- i
	}
	watching := make(chan struct{})
	go func() { defer close(watching); p.watch() }()
	p.takers.Add(1)
	go p.take()
	// The loop ends when the subscription's context does, or the consumer ends.
	p.takers.Wait()
	// Closing: the consumer stops fetching (nothing more is taken, and what the broker would
	// still send for a pull is not left to pile up unread); running handlers get the grace;
	// what is left is given up (released), so it is offered again elsewhere; then it retires.
	bg := context.Background()
	c.Stop(bg)
	done := make(chan struct{})
	go func() { p.busy.Wait(); close(done) }()
	timer := time.NewTimer(grace)
	select {
	case <-done:
	case <-timer.C:
	}
	timer.Stop()
	for i := range p.current {
		if s := p.current[i].Load(); s != nil {
			d := Delivery{s}
			slog.Warn("handler still running at close: attempt given up", "subscription", sub.Name(), "subject", d.Subject())
			d.release(bg)
		}
	}
	cancelHandlers()
	<-watching
	c.Retire(bg)
}

// take takes deliveries and runs their handlers, until the subscription ends or the watcher
// handed taking on (its handler ran past handOff). A goroutine counts in takers while it
// takes: one handed off is only running a handler (in busy), so the close does not wait for it
// before the grace. A handler that returned inline leaves its slot with the taker for the next
// delivery.
func (p *pump) take() {
	slot, held := 0, false
	for {
		if !held {
			select {
			case slot = <-p.free: // a slot is free at once, unless MaxInFlight handlers run
			default:
				select {
				case slot = <-p.free:
				case <-p.ctx.Done():
					p.takers.Done()
					return
				}
			}
		}
		held = false
		d, ok := p.c.Next(p.ctx)
		if !ok {
			p.free <- slot
			if p.ctx.Err() == nil {
				slog.Warn("consumer ended", "subscription", p.sub.Name())
			}
			p.takers.Done()
			return
		}
		p.current[slot].Store(d.s)
		p.busy.Add(1)
		p.sub.started()
		if p.apart {
			go func(slot int) {
				runOne(p.hctx, d, p.h, p.lease, false)
				p.current[slot].Store(nil)
				p.sub.ended()
				p.busy.Done()
				p.free <- slot
			}(slot)
			continue
		}
		p.runs++
		run := p.runs
		p.inlineDelivery.Store(d.s)
		p.inline.Store(run)
		if closing(p.ctx) && p.inline.CompareAndSwap(run, 0) {
			// Taken as the subscription ended (the watcher may be gone): run it on its own
			// goroutine, so the close's grace covers it.
			p.takers.Done()
			go func(slot int) {
				runOne(p.hctx, d, p.h, p.lease, false)
				p.current[slot].Store(nil)
				p.sub.ended()
				p.busy.Done()
			}(slot)
			return
		}
		if p.asleep.Load() {
			select {
			case p.wake <- struct{}{}:
			default:
			}
		}
		runOne(p.hctx, d, p.h, p.lease, true)
		p.current[slot].Store(nil)
		p.sub.ended()
		p.busy.Done()
		if !p.inline.CompareAndSwap(run, 0) {
			p.free <- slot
			return // handed off: another goroutine takes deliveries now
		}
		held = true
	}
}

// closing reports whether ctx has ended, without the lock its Err takes.
func closing(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

// watch hands taking on to a new goroutine when the inline handler runs past handOff, until
// the subscription ends. It sleeps while no handler runs inline. A run is timed from when the
// watcher first saw it (at a tick, or woken as it began), so it is handed on between handOff
// and two handOffs after it began, and its lease keeper counts from a handOff before that
// sighting (never later than the run began: the lease is extended early, not late).
func (p *pump) watch() {
	tick := time.NewTicker(handOff)
	defer tick.Stop()
	var seen uint64 // the run last seen inline, and when
	var seenAt time.Time
	startOf := func(run uint64) time.Time {
		if run == seen {
			return seenAt.Add(-handOff)
		}
		return time.Now().Add(-handOff)
	}
	for {
		run := p.inline.Load()
		if run == 0 {
			p.asleep.Store(true)
			if p.inline.Load() == 0 {
				select {
				case <-p.wake:
				case <-p.ctx.Done():
					p.asleep.Store(false)
					if run := p.inline.Load(); run != 0 && p.inline.CompareAndSwap(run, 0) {
						p.leaseRunning(startOf(run))
						p.takers.Done()
					}
					return
				}
			}
			p.asleep.Store(false)
			if run := p.inline.Load(); run != 0 && run != seen {
				seen, seenAt = run, time.Now()
			}
			continue
		}
		select {
		case <-tick.C:
		case <-p.ctx.Done():
			// No more handoffs: a taker running a handler inline stops being one now, so the
			// close's grace starts without waiting for that handler.
			if run := p.inline.Load(); run != 0 && p.inline.CompareAndSwap(run, 0) {
				p.leaseRunning(startOf(run))
				p.takers.Done()
			}
			return
		}
		run = p.inline.Load()
		switch {
		case run == 0:
		case run != seen:
			seen, seenAt = run, time.Now()
		case time.Since(seenAt) >= handOff && p.inline.CompareAndSwap(run, 0):
			p.leaseRunning(startOf(run))
			p.takers.Add(1) // the new taker, before the old one leaves
			go p.take()
			p.takers.Done()
		}
	}
}

// leaseRunning starts the lease keeper of the run the watcher just took off the taker (the
// handler went on past handOff, or the subscription is closing), counting from start.
// Called only by whoever swapped inline to 0, so inlineDelivery is that run's.
func (p *pump) leaseRunning(start time.Time) {
	if p.lease == nil {
		return
	}
	s := p.inlineDelivery.Load()
	k := keepLease(Delivery{s}, *p.lease, start)
	s.keeper.Store(k)
	if s.ran.Load() {
		k.stop() // the handler returned meanwhile: runOne may not have seen the keeper
	}
}

// runOne runs one handler on one delivery: contains a panic, counts a returned error, keeps
// the lease, and settles silence. A handler run inline gets its lease keeper only if it runs
// past handOff (leaseRunning): a timer per delivery cost a fifth of the throughput, and the
// first extension is due half an ackWait after the start, far beyond handOff.
func runOne(ctx context.Context, d Delivery, h Handler, lease *leaseTimes, inline bool) {
	if lease != nil && !inline {
		d.s.keeper.Store(keepLease(d, *lease, time.Now()))
	}
	err, panicked := call(ctx, d, h)
	// Either this sees the keeper leaseRunning stored, or leaseRunning sees ran and stops it.
	d.s.ran.Store(true)
	if k := d.s.keeper.Load(); k != nil {
		k.stop()
	}
	if d.s.fate.Load() == fateReleased {
		return // given up at close: what it did after is not counted (the Rust runtime aborts it)
	}
	switch {
	case panicked != nil:
		d.count(cPanics)
		slog.Error("handler panicked: contained, treated as silence", "subscription", d.Subscription(), "subject", d.Subject(), "attempt", d.Attempt(), "panic", fmt.Sprint(panicked))
	case err != nil:
		d.count(cHandlerErrors)
		slog.Warn("handler returned an error (it does not decide settlement)", "subscription", d.Subscription(), "subject", d.Subject(), "attempt", d.Attempt(), "settled", d.Settled(), "error", err)
	}
	d.complete(context.Background())
}

func call(ctx context.Context, d Delivery, h Handler) (err error, panicked any) {
	defer func() {
		if p := recover(); p != nil {
			panicked = p
		}
	}()
	return h(ctx, d), nil
}

// leaseKeeper extends a delivery's lease half an AckWait before each lease runs out, up to
// MaxProcessingTime, then counts LeaseExpired when the last lease runs out with the handler
// still running (H1, H2). One timer at a time; nothing runs between them.
type leaseKeeper struct {
	d         Delivery
	l         leaseTimes
	bound     time.Time
	heldUntil time.Time
	mu        sync.Mutex
	timer     *time.Timer
	stopped   bool
}

// keepLease keeps d's lease, taken at start.
func keepLease(d Delivery, l leaseTimes, start time.Time) *leaseKeeper {
	k := &leaseKeeper{d: d, l: l, bound: start.Add(l.maxProcessing), heldUntil: start.Add(l.ackWait)}
	k.mu.Lock()
	k.next()
	k.mu.Unlock()
	return k
}

// next schedules the next extension, or the expiry check when none is left (k.mu held).
func (k *leaseKeeper) next() {
	regular := k.heldUntil.Add(-k.l.ackWait / 2)
	var at time.Time
	switch {
	case !regular.Add(k.l.ackWait).After(k.bound):
		at = regular
	case k.heldUntil.Before(k.bound):
		// The last extension, timed so that the lease ends at MaxProcessingTime.
		at = k.bound.Add(-k.l.ackWait)
	default:
		k.timer = time.AfterFunc(time.Until(k.heldUntil), k.expire)
		return
	}
	k.timer = time.AfterFunc(time.Until(at), k.extend)
}

func (k *leaseKeeper) extend() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped || k.d.Settled() {
		return
	}
	if r := k.d.s.onSettle.Progress(context.Background()); r != nil {
		slog.Warn("could not extend the lease", "subscription", k.d.Subscription(), "reason", r.Reason)
		k.timer = time.AfterFunc(time.Until(k.heldUntil), k.expire)
		return
	}
	k.heldUntil = time.Now().Add(k.l.ackWait)
	k.next()
}

func (k *leaseKeeper) expire() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped || k.d.Settled() {
		return
	}
	k.d.count(cLeaseExpired)
	slog.Warn("handler ran past maxProcessingTime: the message is handed on while it may still run (LeaseExpired)", "subscription", k.d.Subscription(), "subject", k.d.Subject(), "attempt", k.d.Attempt())
}

func (k *leaseKeeper) stop() {
	k.mu.Lock()
	k.stopped = true
	if k.timer != nil {
		k.timer.Stop()
	}
	k.mu.Unlock()
}
