package main

import "testing"

// The draw is the Rust app's (examples/account_app.rs model_answer), so a campaign can run Go
// and Rust instances side by side with one checker: these values are the Rust function's.
func TestTheDrawIsTheRustAppsDraw(t *testing.T) {
	for _, c := range []struct {
		seed, id uint64
		attempt  int
		want     uint64
	}{
		{0, 0, 0, 0},
		{377, 1, 1, 5850652464473074940},
		{1796666591402080080, 1199, 4, 6708470482063311030},
	} {
		if got := draw(c.seed, c.id, c.attempt); got != c.want {
			t.Errorf("draw(%d, %d, %d) = %d, want %d", c.seed, c.id, c.attempt, got, c.want)
		}
	}
}
