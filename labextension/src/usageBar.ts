/**
 * The small usage bar shared by the status item and the panel: the track is
 * the limit, a tick marks the request (the guaranteed part), the fill is the
 * usage, coloured differently where it runs past the request (loaned memory).
 */
import { h } from './dom';

export interface IBarFigures {
  usage?: number | null;
  request?: number | null;
  limit?: number | null;
}

function pct(x: number): string {
  return `${Math.max(0, Math.min(100, x * 100)).toFixed(1)}%`;
}

export function usageBar(figures: IBarFigures, className = ''): HTMLElement {
  const usage = Math.max(0, figures.usage ?? 0);
  const request = Math.max(0, figures.request ?? 0);
  const limit = Math.max(request, figures.limit ?? request);
  // Usage over the limit can happen for a moment before reclaim acts.
  const scale = Math.max(limit, usage, 1);
  const guaranteedFill = Math.min(usage, request) / scale;
  const loanedFill = Math.max(0, usage - request) / scale;

  const bar = h('div', {
    class: `jp-gpufrac-Bar ${className}`.trim(),
    // The numbers are in the surrounding label; the bar is decoration.
    'aria-hidden': 'true'
  });
  // The guaranteed zone stays visible even while nothing is used.
  bar.appendChild(
    h('div', {
      class: 'jp-gpufrac-Bar-zone',
      style: `width: ${pct(request / scale)}`
    })
  );
  bar.appendChild(
    h('div', {
      class: 'jp-gpufrac-Bar-guaranteed',
      style: `width: ${pct(guaranteedFill)}`
    })
  );
  if (loanedFill > 0) {
    bar.appendChild(
      h('div', {
        class: 'jp-gpufrac-Bar-loaned',
        style: `left: ${pct(request / scale)}; width: ${pct(loanedFill)}`
      })
    );
  }
  if (request > 0 && request < scale) {
    bar.appendChild(
      h('div', {
        class: 'jp-gpufrac-Bar-request',
        style: `left: ${pct(request / scale)}`
      })
    );
  }
  return bar;
}
