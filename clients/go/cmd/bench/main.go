// Command bench measures the Go runtime's throughput against a bare client doing the same
// acks, on the environment's brokers, and prints the ratio per broker (the goal: at least
// 0.95). Each round fills a place of its own (a stream, an exchange and its queues, SQS
// queues) with the same messages for both sides, then drains them twice in alternating order:
// once with the broker's own client acknowledging every message the way the runtime does
// (the floor any runtime pays), once through a messaging.Bus whose handler acks (AtLeastOnce,
// the same consumer or queue). Beside the rates it prints this process's CPU a message on
// each side, the figure two shared cores disturb least.
//
//	go run ./cmd/bench [-broker nats,rabbitmq,sqs] [-messages N] [-rounds 9]
//
// It needs the environment's variables (`make env-up`, then `source target/env/settle.env`);
// a broker whose variable is unset is skipped, saying so.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime/pprof"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	messaging "settle.dev/messaging"
)

// place is one round's fill on one broker: the two drains (each takes every message waiting
// for its side and acks it) and what to remove after.
type place struct {
	bare    func() error
	runtime messaging.Backend
	spec    messaging.SubscriptionSpec
	cleanup func()
}

// broker makes a place per round.
type broker struct {
	name     string
	env      string
	messages int // per round unless -messages is given
	prepare  func(ctx context.Context, url string, round, messages int) (place, error)
}

var brokers = []broker{
	{name: "nats", env: "SETTLE_NATS_URL", messages: 60000, prepare: natsPlace},
	{name: "rabbitmq", env: "SETTLE_RABBITMQ_URL", messages: 10000, prepare: rabbitPlace},
	{name: "sqs", env: "SETTLE_SQS_ENDPOINT", messages: 2000, prepare: sqsPlace},
}

func main() {
	which := flag.String("broker", "nats,rabbitmq,sqs", "the brokers to measure, by name")
	messages := flag.Int("messages", 0, "messages a round (0: each broker's default: NATS 60,000, RabbitMQ 10,000, SQS 2,000)")
	rounds := flag.Int("rounds", 9, "rounds (the median is the figure)")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the whole run here")
	only := flag.String("only", "", "drain with one side only (bare or runtime), to look at it with a profiler")
	flag.Parse()
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
	if *profile != "" {
		f, err := os.Create(*profile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	failed := false
	for _, b := range brokers {
		if !strings.Contains(","+*which+",", ","+b.name+",") {
			continue
		}
		url := os.Getenv(b.env)
		if url == "" {
			fmt.Printf("%s: skipped, %s is not set (`make env-up`, then `source target/env/settle.env`)\n", b.name, b.env)
			continue
		}
		n := b.messages
		if *messages > 0 {
			n = *messages
		}
		if err := measure(b, url, n, *rounds, *only); err != nil {
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", b.name, err)
			failed = true
		}
	}
	if failed {
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

// side is one side's figures, a round each.
type side struct{ rate, cpu []float64 }

func (s *side) add(messages int, wall, cpu time.Duration) {
	s.rate = append(s.rate, float64(messages)/wall.Seconds())
	s.cpu = append(s.cpu, cpu.Seconds()*1e6/float64(messages))
}

func measure(b broker, url string, messages, rounds int, only string) error {
	ctx := context.Background()
	var bare, rt side
	for r := range rounds {
		p, err := b.prepare(ctx, url, r, messages)
		if err != nil {
			return err
		}
		drainBare := func() error {
			start, cpu := time.Now(), cpuTime()
			if err := p.bare(); err != nil {
				return err
			}
			bare.add(messages, time.Since(start), cpuTime()-cpu)
			return nil
		}
		drainRuntime := func() error {
			start, cpu := time.Now(), cpuTime()
			if err := drain(ctx, p.runtime, p.spec, messages); err != nil {
				return err
			}
			rt.add(messages, time.Since(start), cpuTime()-cpu)
			return nil
		}
		order := []func() error{drainBare, drainRuntime} // alternated: neither always runs on a warmer broker
		if r%2 == 1 {
			order = []func() error{drainRuntime, drainBare}
		}
		switch only {
		case "bare":
			order = []func() error{drainBare}
		case "runtime":
			order = []func() error{drainRuntime}
		}
		for _, f := range order {
			if err := f(); err != nil {
				p.cleanup()
				return err
			}
		}
		p.cleanup()
		if only == "" {
			fmt.Printf("%s round %d: bare %.0f msg/s, runtime %.0f msg/s, ratio %.3f; CPU a message bare %.2f µs, runtime %.2f µs\n",
				b.name, r+1, bare.rate[r], rt.rate[r], rt.rate[r]/bare.rate[r], bare.cpu[r], rt.cpu[r])
		}
	}
	if only != "" {
		s := map[string]side{"bare": bare, "runtime": rt}[only]
		fmt.Printf("%s: %s only, %d messages, %d rounds: median %.0f msg/s, CPU a message %.2f µs\n", b.name, only, messages, rounds, median(s.rate), median(s.cpu))
		return nil
	}
	ratios := make([]float64, rounds)
	for i := range ratios {
		ratios[i] = rt.rate[i] / bare.rate[i]
	}
	fmt.Printf("%s: %d messages a round, %d rounds; median bare %.0f msg/s, runtime %.0f msg/s; ratio of medians %.3f (rounds' ratios: median %.3f, min %.3f, max %.3f)\n",
		b.name, messages, rounds, median(bare.rate), median(rt.rate), median(rt.rate)/median(bare.rate), median(ratios), minOf(ratios), maxOf(ratios))
	fmt.Printf("%s: CPU a message in this process (the client's side of the wire), median bare %.2f µs, runtime %.2f µs: the runtime adds %.2f µs\n",
		b.name, median(bare.cpu), median(rt.cpu), median(rt.cpu)-median(bare.cpu))
	return nil
}

// drain takes every waiting message through a bus whose handler acks.
func drain(ctx context.Context, b messaging.Backend, spec messaging.SubscriptionSpec, messages int) error {
	var done atomic.Int64
	finished := make(chan struct{})
	bus := messaging.New(b, messaging.Options{NoReports: true})
	defer bus.Close()
	spec.Mode = messaging.AtLeastOnce
	spec.Handler = func(_ context.Context, d messaging.Delivery) error {
		err := d.Ack()
		if done.Add(1) == int64(messages) {
			close(finished)
		}
		return err
	}
	if err := bus.Subscribe(ctx, spec); err != nil {
		return err
	}
	select {
	case <-finished:
		return nil
	case <-time.After(10 * time.Minute):
		return fmt.Errorf("the runtime took %d of %d messages in 10 minutes", done.Load(), messages)
	}
}

// made lets the runtime make a subscription's consumer or queue, before anything is sent:
// both sides then drain what they are made the same way.
func made(ctx context.Context, b messaging.Backend, spec messaging.SubscriptionSpec) error {
	bus := messaging.New(b, messaging.Options{NoReports: true})
	defer bus.Close()
	spec.Mode = messaging.AtLeastOnce
	spec.Handler = func(context.Context, messaging.Delivery) error { return nil }
	return bus.Subscribe(ctx, spec)
}

// cpuTime is the CPU this process has used (user and system).
func cpuTime() time.Duration {
	var u syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &u) != nil {
		return 0
	}
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func minOf(xs []float64) float64 {
	m := xs[0]
	for _, x := range xs {
		m = min(m, x)
	}
	return m
}

func maxOf(xs []float64) float64 {
	m := xs[0]
	for _, x := range xs {
		m = max(m, x)
	}
	return m
}
