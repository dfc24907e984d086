// Package conformance runs the shared conformance scenes (conformance/scenes.json at the
// repository's root, the same file the Rust runtime runs) on a broker: each scene's
// subscription, messages and handler answers, and what the account must then say. How a
// scene reads is conformance/README.md. It must not know any broker: a Scope says what
// differs (how a backend is made, what a subscription's subject is, how a message is sent).
package conformance

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	messaging "settle.dev/messaging"
)

// File is the scenes file.
type File struct {
	Version int     `json:"version"`
	Scenes  []Scene `json:"scenes"`
}

// Scene is one scene of the file.
type Scene struct {
	Name             string                `json:"name"`
	Rules            []string              `json:"rules"`
	Requires         string                `json:"requires"`
	Spec             Spec                  `json:"spec"`
	Messages         int                   `json:"messages"`
	Answers          Answers               `json:"answers"`
	Body             map[string]string     `json:"body"`
	Headers          map[string]HeaderSet  `json:"headers"`
	CloseWhenOffered uint64                `json:"closeWhenOffered"`
	CloseGrace       string                `json:"closeGrace"`
	Expect           Expect                `json:"expect"`
	Then             *Phase                `json:"then"`
	On               map[string]Difference `json:"on"`
}

// HeaderSet is a message's transport headers, by name.
type HeaderSet map[string]string

// Spec is the subscription's policy as the scene gives it.
type Spec struct {
	Mode              string `json:"mode"`
	MaxDeliver        int    `json:"maxDeliver"`
	MaxNackDelay      string `json:"maxNackDelay"`
	AckWait           string `json:"ackWait"`
	MaxProcessingTime string `json:"maxProcessingTime"`
	SlowHandler       string `json:"slowHandler"`
}

// Answers is what the handler does, by attempt (the last repeats): for every message, for
// even and odd message ids, or for each id.
type Answers struct {
	All  []string   `json:"all"`
	Even []string   `json:"even"`
	Odd  []string   `json:"odd"`
	Each [][]string `json:"each"`
}

// Expect is what the account must say.
type Expect struct {
	Stats          *messaging.ConsumerStats `json:"stats"`
	Runtime        *messaging.RuntimeStats  `json:"runtime"`
	Attempts       [][]int                  `json:"attempts"`
	AlreadySettled int                      `json:"alreadySettled"`
	GapsAtLeast    string                   `json:"gapsAtLeast"`
}

// Phase is a second bus after the first closed.
type Phase struct {
	Expect Expect `json:"expect"`
}

// Difference is what a broker shows instead, and why.
type Difference struct {
	Why    string `json:"why"`
	Expect Expect `json:"expect"`
	Then   *Phase `json:"then"`
}

// Load reads the scenes file at the repository's root.
func Load() (File, error) {
	_, here, _, _ := runtime.Caller(0)
	path := filepath.Join(filepath.Dir(here), "..", "..", "..", "conformance", "scenes.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		return File{}, err
	}
	var f File
	if err := json.Unmarshal(raw, &f); err != nil {
		return File{}, fmt.Errorf("%s: %w", path, err)
	}
	if f.Version != 1 {
		return File{}, fmt.Errorf("%s: version %d, this runner reads 1", path, f.Version)
	}
	return f, nil
}

// Scope is what differs per broker.
type Scope interface {
	// Broker is the broker's name in the file's "on" (memory, nats, rabbitmq, sqs).
	Broker() string
	// Backend is a backend on the scope's broker; two reach the same messages.
	Backend() (messaging.Backend, error)
	// Base is scene n's subscription (name, pattern, durable name) before the scene's policy.
	Base(n int) messaging.SubscriptionSpec
	// Send publishes body with headers to scene n's subscription.
	Send(ctx context.Context, b messaging.Backend, n int, body []byte, headers []messaging.Header) error
}

// Outcome is what one phase of a scene showed.
type Outcome struct {
	Stats          messaging.ConsumerStats
	Runtime        messaging.RuntimeStats
	Attempts       [][]int
	Gaps           []time.Duration
	AlreadySettled int
}

type seen struct {
	mu       sync.Mutex
	attempts map[int][]int
	times    map[int][]time.Time
	already  int
}

func (s *seen) record(id, attempt int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.attempts[id] = append(s.attempts[id], attempt)
	s.times[id] = append(s.times[id], time.Now())
}

func duration(s string) time.Duration {
	if s == "" {
		return 0
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		panic(fmt.Sprintf("scenes.json: %q is not a duration", s))
	}
	return d
}

// Spec is the scene's subscription on scope, n its index.
func (sc Scene) spec(scope Scope, n int) messaging.SubscriptionSpec {
	s := scope.Base(n)
	if sc.Spec.Mode == "AtLeastOnce" {
		s.Mode = messaging.AtLeastOnce
	} else {
		s.Mode = messaging.AtMostOnce
	}
	s.MaxDeliver = sc.Spec.MaxDeliver
	s.MaxNackDelay = duration(sc.Spec.MaxNackDelay)
	s.AckWait = duration(sc.Spec.AckWait)
	s.MaxProcessingTime = duration(sc.Spec.MaxProcessingTime)
	if sc.Spec.SlowHandler == "Redeliver" {
		s = s.WithSlowHandler(messaging.Redeliver)
	}
	return s
}

func (sc Scene) answer(id, attempt int) string {
	list := sc.Answers.All
	switch {
	case sc.Answers.Each != nil && id < len(sc.Answers.Each):
		list = sc.Answers.Each[id]
	case id%2 == 0 && sc.Answers.Even != nil:
		list = sc.Answers.Even
	case id%2 == 1 && sc.Answers.Odd != nil:
		list = sc.Answers.Odd
	}
	if len(list) == 0 {
		return "silent"
	}
	return list[min(attempt, len(list))-1]
}

func parity(id int) string {
	if id%2 == 0 {
		return "even"
	}
	return "odd"
}

// message is message id's body and headers.
func (sc Scene) message(id int) ([]byte, []messaging.Header) {
	body := fmt.Sprintf(`{"id":%d}`, id)
	if b, ok := sc.Body[parity(id)]; ok {
		body = b
	}
	var hs []messaging.Header
	for k, v := range sc.Headers[parity(id)] {
		hs = append(hs, messaging.Header{Name: k, Value: v})
	}
	return []byte(body), hs
}

var errAnswered = errors.New("the scene's handler returns an error")

// handler does what the scene says with each attempt.
func (sc Scene) handler(s *seen) messaging.Handler {
	return func(ctx context.Context, d messaging.Delivery) error {
		var m struct{ ID int }
		if err := d.Decode(&m); err != nil {
			return err
		}
		s.record(m.ID, d.Attempt())
		var ret error
		for _, step := range strings.Split(sc.answer(m.ID, d.Attempt()), "+") {
			var err error
			switch {
			case step == "ack":
				err = d.Ack()
			case step == "nack":
				err = d.Nack()
			case step == "silent":
			case step == "error":
				ret = errAnswered
			case step == "panic":
				panic("the scene's handler panics")
			case strings.HasPrefix(step, "nackAfter:"):
				err = d.NackAfter(duration(strings.TrimPrefix(step, "nackAfter:")))
			case strings.HasPrefix(step, "sleep:"):
				messaging.Sleep(ctx, duration(strings.TrimPrefix(step, "sleep:")))
			default:
				panic(fmt.Sprintf("scenes.json: unknown answer %q", step))
			}
			if errors.Is(err, messaging.ErrAlreadySettled) {
				s.mu.Lock()
				s.already++
				s.mu.Unlock()
			}
		}
		return ret
	}
}

// Run runs scene n on scope: each phase's outcome, and what the scene expected of it on this
// broker (its "on" entry where it has one).
func Run(ctx context.Context, scope Scope, sc Scene, n int) (got []Outcome, want []Expect, err error) {
	want = []Expect{sc.Expect}
	then := sc.Then
	if d, ok := sc.On[scope.Broker()]; ok {
		want[0] = d.Expect
		if d.Then != nil {
			then = d.Then
		}
	}
	if then != nil {
		want = append(want, then.Expect)
	}
	spec := sc.spec(scope, n)
	for phase := range want {
		b, err := scope.Backend()
		if err != nil {
			return nil, nil, err
		}
		s := &seen{attempts: map[int][]int{}, times: map[int][]time.Time{}}
		bus := messaging.New(b, messaging.Options{NoReports: true, CloseGrace: max(duration(sc.CloseGrace), 0)})
		spec.Handler = sc.handler(s)
		if err := bus.Subscribe(ctx, spec); err != nil {
			return nil, nil, fmt.Errorf("subscribe: %w", err)
		}
		if phase == 0 {
			for id := range sc.Messages {
				body, hs := sc.message(id)
				if err := scope.Send(ctx, b, n, body, hs); err != nil {
					bus.Close()
					return nil, nil, fmt.Errorf("publish: %w", err)
				}
			}
		}
		closeAt := uint64(0)
		if phase == 0 {
			closeAt = sc.CloseWhenOffered
		}
		if err := settle(ctx, bus, spec.Name, want[phase], closeAt); err != nil {
			bus.Close()
			return nil, nil, err
		}
		bus.Close()
		if c, ok := b.(interface{ Close() }); ok {
			c.Close()
		}
		st, _ := bus.Stats(spec.Name)
		rt, _ := bus.RuntimeStats(spec.Name)
		got = append(got, s.outcome(st, rt, sc.Messages))
	}
	return got, want, nil
}

// settle waits until the phase is over: closeAt offered, or every attempt expected offered
// and finished, then a second with nothing new.
func settle(ctx context.Context, bus *messaging.Bus, name string, want Expect, closeAt uint64) error {
	deadline := time.Now().Add(90 * time.Second)
	target := uint64(1)
	if want.Stats != nil {
		target = want.Stats.Offered
	}
	var last messaging.ConsumerStats
	quietSince := time.Time{}
	for {
		st, _ := bus.Stats(name)
		switch {
		case closeAt > 0 && st.Offered >= closeAt:
			return nil
		case closeAt == 0 && st.Offered >= target && st.Delivered+st.Released+st.Lost == st.Offered:
			if st != last || quietSince.IsZero() {
				quietSince, last = time.Now(), st
			} else if time.Since(quietSince) >= time.Second {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out waiting for %d attempts offered and finished: %+v", target, st)
		}
		if !messaging.Sleep(ctx, 20*time.Millisecond) {
			return ctx.Err()
		}
	}
}

func (s *seen) outcome(st messaging.ConsumerStats, rt messaging.RuntimeStats, messages int) Outcome {
	s.mu.Lock()
	defer s.mu.Unlock()
	o := Outcome{Stats: st, Runtime: rt, AlreadySettled: s.already}
	for id := range messages {
		o.Attempts = append(o.Attempts, s.attempts[id])
		t := s.times[id]
		for i := 1; i < len(t); i++ {
			o.Gaps = append(o.Gaps, t[i].Sub(t[i-1]))
		}
	}
	return o
}

// Check says how an outcome differs from what was expected ("" when it does not).
func Check(got Outcome, want Expect) string {
	var diffs []string
	if want.Stats != nil && got.Stats != *want.Stats {
		g, _ := json.Marshal(got.Stats)
		w, _ := json.Marshal(want.Stats)
		diffs = append(diffs, fmt.Sprintf("stats %s, want %s", g, w))
	}
	wantRt := messaging.RuntimeStats{}
	if want.Runtime != nil {
		wantRt = *want.Runtime
	}
	if got.Runtime != wantRt {
		diffs = append(diffs, fmt.Sprintf("runtime %+v, want %+v", got.Runtime, wantRt))
	}
	if want.Attempts != nil {
		ga := make([][]int, len(got.Attempts))
		for i, a := range got.Attempts {
			ga[i] = append([]int{}, a...)
		}
		if !reflect.DeepEqual(ga, want.Attempts) {
			diffs = append(diffs, fmt.Sprintf("attempts %v, want %v", ga, want.Attempts))
		}
	}
	if got.AlreadySettled != want.AlreadySettled {
		diffs = append(diffs, "alreadySettled "+strconv.Itoa(got.AlreadySettled)+", want "+strconv.Itoa(want.AlreadySettled))
	}
	if floor := duration(want.GapsAtLeast); floor > 0 {
		for _, g := range got.Gaps {
			if g < floor {
				diffs = append(diffs, fmt.Sprintf("a redelivery came %s after the attempt before it, before its delay of %s", g, floor))
			}
		}
	}
	return strings.Join(diffs, "; ")
}
