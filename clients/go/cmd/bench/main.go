// Command bench measures the Go runtime's throughput against a bare client doing the same
// acks, on the environment's brokers, and prints the ratio per broker (issue: at least 0.95).
// Each round publishes the same messages to a stream of its own and drains them twice: once
// with a bare nats.go pull consumer that acks every message (the floor any runtime pays), once
// through a messaging.Bus whose handler acks (AtLeastOnce, the same consumer settings).
//
//	go run ./cmd/bench [-messages 20000] [-rounds 5]
//
// It needs SETTLE_NATS_URL (`make env-up`, then `source target/env/settle.env`).
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
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	messaging "settle.dev/messaging"
	settlenats "settle.dev/messaging/nats"
)

func main() {
	messages := flag.Int("messages", 20000, "messages per round")
	rounds := flag.Int("rounds", 5, "rounds (the median is the figure)")
	profile := flag.String("cpuprofile", "", "write a CPU profile of the runtime's drains here")
	flag.Parse()
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError})))
	url := os.Getenv("SETTLE_NATS_URL")
	if url == "" {
		fmt.Fprintln(os.Stderr, "bench: SETTLE_NATS_URL is not set: `make env-up`, then `source target/env/settle.env`")
		os.Exit(2)
	}
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	if err := natsRounds(url, *messages, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func natsRounds(url string, messages, rounds int) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx := context.Background()
	var bare, runtime []float64
	for r := range rounds {
		prefix := fmt.Sprintf("gobench.%d.%d", os.Getpid(), r)
		stream := strings.ReplaceAll(prefix, ".", "_")
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
			return err
		}
		payload := []byte(`{"id":1,"item":"a benchmark order of about a hundred bytes, as orders go ......"}`)
		futures := make([]jetstream.PubAckFuture, 0, messages)
		for range messages {
			f, err := js.PublishAsync(prefix+".m", payload)
			if err != nil {
				return err
			}
			futures = append(futures, f)
		}
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return err
			}
		}
		p := messaging.SubscriptionSpec{Name: "bench", Pattern: prefix + ".>", Mode: messaging.AtLeastOnce, DurableName: "bare", MaxDeliver: 5}.Resolve()

		// Alternate which goes first, so neither always runs on a warmer server.
		runBare := func() error {
			// Bare: the same consumer settings, a pull loop that acks.
			cons, err := js.CreateConsumer(ctx, stream, settlenats.Desired("bench", "bare", p))
			if err != nil {
				return err
			}
			start := time.Now()
			// The pull the runtime makes (nats/consume.go): the same batch, bytes, expiry and heartbeat.
			it, err := cons.Messages(jetstream.PullMaxMessagesWithBytesLimit(250, 2<<20),
				jetstream.PullExpiry(10*time.Second), jetstream.PullHeartbeat(3*time.Second))
			if err != nil {
				return err
			}
			for range messages {
				m, err := it.Next()
				if err != nil {
					return err
				}
				if err := m.Ack(); err != nil {
					return err
				}
			}
			bare = append(bare, float64(messages)/time.Since(start).Seconds())
			it.Stop()

			return nil
		}
		runRuntime := func() error {
			// The runtime: a bus whose handler acks.
			b, err := settlenats.Connect(url, "bench")
			if err != nil {
				return err
			}
			var done atomic.Int64
			var last, gap atomic.Int64
			var first atomic.Int64
			finished := make(chan struct{})
			bus := messaging.New(b, messaging.Options{NoReports: true})
			start := time.Now()
			err = bus.Subscribe(ctx, messaging.SubscriptionSpec{
				Name: "bench", Pattern: prefix + ".>", Mode: messaging.AtLeastOnce, DurableName: "runtime", MaxDeliver: 5,
				Handler: func(_ context.Context, d messaging.Delivery) error {
					now := time.Now().UnixNano()
					first.CompareAndSwap(0, now)
					if l := last.Swap(now); l != 0 && now-l > gap.Load() {
						gap.Store(now - l)
					}
					err := d.Ack()
					if done.Add(1) == int64(messages) {
						close(finished)
					}
					return err
				},
			})
			if err != nil {
				return err
			}
			<-finished
			if os.Getenv("BENCH_DEBUG") != "" {
				fmt.Printf("first delivery after %s, longest gap %s\n", time.Duration(first.Load()-start.UnixNano()), time.Duration(gap.Load()))
			}
			runtime = append(runtime, float64(messages)/time.Since(start).Seconds())
			bus.Close()
			b.Close()
			return nil
		}
		first, second := runBare, runRuntime
		if r%2 == 1 {
			first, second = runRuntime, runBare
		}
		if err := first(); err != nil {
			return err
		}
		if err := second(); err != nil {
			return err
		}
		_ = js.DeleteStream(ctx, stream)
		fmt.Printf("nats round %d: bare %.0f msg/s, runtime %.0f msg/s, ratio %.3f\n", r+1, bare[r], runtime[r], runtime[r]/bare[r])
	}
	fmt.Printf("nats: %d messages a round, %d rounds; median bare %.0f msg/s, runtime %.0f msg/s; ratio of medians %.3f (min %.3f, max %.3f)\n",
		messages, rounds, median(bare), median(runtime), median(runtime)/median(bare), minRatio(runtime, bare), maxRatio(runtime, bare))
	return nil
}

func minRatio(a, b []float64) float64 {
	m := a[0] / b[0]
	for i := range a {
		m = min(m, a[i]/b[i])
	}
	return m
}

func maxRatio(a, b []float64) float64 {
	m := a[0] / b[0]
	for i := range a {
		m = max(m, a[i]/b[i])
	}
	return m
}
